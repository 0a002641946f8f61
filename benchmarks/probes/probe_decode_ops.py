"""Where a decode step of an engine's decode graph spends its time (batch 1 unless `--rows`): kernel time per op type
from ONNX Runtime's profiler (a separate run: the profiler itself slows small nodes), then, for a graph with
block minima (int4 from fp32 checkpoints, gguf's Q4_1), the step timed against a copy with the minimum's
exact share removed (block sums, the small GEMM and its Add; that copy's output is wrong: timing only).
The two graphs take turns; medians of `--steps` steps per round over `--rounds` rounds, random ids.

    .venv/bin/python -m benchmarks.probes.probe_decode_ops --engine engines/smollm2-int4 [--past 128] [--rows 1]

With --rows N the profiled step decodes N sequences (each slot first prefilled with `--past` tokens in one
call, whose kernel time is shown beside), and the minimum's timing is left out.

With --against DIR, the decode graph is instead timed step against step with another engine's (paired rounds,
the order alternating; the median of the per-round ratios), for two builds of one checkpoint:

    .venv/bin/python -m benchmarks.probes.probe_decode_ops --engine NEW --against OLD --rounds 40 --steps 12
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

MINIMUM_SUFFIXES = (".shift", ".blocks", ".blocksum")  # precision.blocked names the minimum's nodes so


def session(path: Path, threads: int, profile_prefix: str | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # stored optimized already
    if profile_prefix:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def op_times(engine, graph: Path, past: int, steps: int, threads: int, rows: int = 1) -> tuple[dict, dict, dict]:
    """Kernel milliseconds per op type of a decode step over `rows` slots, each holding `past` tokens (after
    one prefill call of `past` tokens per slot), node counts per op type, and the milliseconds of one such
    prefill call per op type."""
    from trtserve.runtime.kv_slots import KVSlots

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        s = session(graph, threads, os.path.join(tmp, "profile"))
        slots = KVSlots(engine, rows, threads, session=s)
        for row in range(rows):
            slots.clear(row)
            slots.run(row, rng.integers(0, 1000, (1, past)), np.array([past]), np.array([[past - 1]]))
        for _ in range(steps):
            slots.run(0, rng.integers(0, 1000, (rows, 1)), np.ones(rows, np.int64), np.zeros((rows, 1), np.int64))
        events = json.load(open(s.end_profiling()))
    runs = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run = len(runs) // (steps + rows)
    ms, count, prefill = collections.Counter(), collections.Counter(), collections.Counter()
    for e in runs[:per_run * rows]:  # the prefill calls first
        prefill[e["args"]["op_name"]] += e["dur"] / 1000 / rows
    for e in runs[per_run * rows:]:
        ms[e["args"]["op_name"]] += e["dur"] / 1000 / steps
        count[e["args"]["op_name"]] += 1
    return dict(ms), {k: v // steps for k, v in count.items()}, dict(prefill)


def without_minimum(graph: Path, out: Path) -> int:
    """A copy of `graph` whose GEMMs skip their block minimum's share; returns how many Adds were bypassed."""
    import onnx

    from trtserve.engine_builder.onnxruntime import weight_files

    model = onnx.load(str(graph), load_external_data=False)
    bypassed = 0
    for node in model.graph.node:
        if node.name.endswith(".add_shift"):
            node.op_type, node.input[:] = "Identity", [node.input[0]]
            bypassed += 1
    kept = [n for n in model.graph.node if not n.name.endswith(MINIMUM_SUFFIXES)]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    for name in weight_files(graph):  # the same external weight files, by name
        shutil.copyfile(graph.parent / name, out.parent / name)
    onnx.save(model, str(out))
    return bypassed


def paired(engine, other, args) -> None:
    """Step time of two engines' decode graphs in paired rounds; the median of each round's ratio."""
    from benchmarks.common.decode import slot_steps
    from trtserve.runtime.kv_slots import KV_GRAPH, KVSlots

    slots = [KVSlots(e, 1, args.threads, session=session(e.file(KV_GRAPH), args.threads)) for e in (engine, other)]
    times: list[list[float]] = [[], []]
    for r in range(args.rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            times[i].append(statistics.median(slot_steps(slots[i], args.past, args.steps, np.random.default_rng(r))))
    ratios = [a / b for a, b in zip(*times)]
    print(f"batch-1 step at past {args.past}, {args.rounds} paired rounds of {args.steps} steps: "
          f"{args.engine} {statistics.median(times[0]) * 1000:.2f} ms, {args.against} "
          f"{statistics.median(times[1]) * 1000:.2f} ms; median ratio {statistics.median(ratios):.3f} "
          f"(quartiles {np.percentile(ratios, 25):.3f} to {np.percentile(ratios, 75):.3f})")


def main() -> None:
    from benchmarks.common.decode import slot_steps
    from trtserve.engine_dir import open_engine_dir
    from trtserve.runtime.kv_slots import KV_GRAPH, KVSlots

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1, help="sequences decoded by each profiled step")
    parser.add_argument("--against", help="another engine's decode graph to time this one against, paired")
    args = parser.parse_args()
    engine = open_engine_dir(args.engine)
    graph = engine.file(KV_GRAPH)
    if not graph.is_file():
        sys.exit(f"{args.engine} has no decode graph: rebuild it with this trtserve")
    if args.against:
        return paired(engine, open_engine_dir(args.against), args)
    ms, count, prefill = op_times(engine, graph, args.past, args.steps, args.threads, args.rows)
    total, prefill_total = sum(ms.values()), sum(prefill.values())
    print(f"kernel time per step of {args.rows} row(s) at past {args.past} (profiler on): {total:.2f} ms, "
          f"{sum(count.values())} nodes; one prefill call of {args.past} tokens: {prefill_total:.2f} ms")
    print("| op | ms per step | share | nodes | ms per prefill call | share |\n|---|---|---|---|---|---|")
    for op, value in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"| {op} | {value:.3f} | {value / total:.1%} | {count[op]} | {prefill.get(op, 0):.3f} | "
              f"{prefill.get(op, 0) / prefill_total:.1%} |")
    if args.rows > 1:
        return
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / graph.name
        if not without_minimum(graph, copy):
            return print("no block minima in this graph: nothing to compare")
        sessions = {"as built": session(graph, args.threads),
                    "without the minimum (wrong output)": session(copy, args.threads)}
        steps = {name: [] for name in sessions}
        for r in range(args.rounds):
            for name, s in sessions.items():
                times = slot_steps(KVSlots(engine, 1, args.threads, session=s), args.past, args.steps,
                                   np.random.default_rng(r))
                steps[name].append(statistics.median(times))
    built = statistics.median(steps["as built"])
    print(f"\nstep time at past {args.past}, medians of {args.rounds} rounds of {args.steps} steps (profiler off):")
    for name, values in steps.items():
        value = statistics.median(values)
        print(f"- {name}: {value * 1000:.2f} ms ({value / built:.2f}x)")


if __name__ == "__main__":
    main()

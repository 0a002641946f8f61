"""One decode step at batch 1 after pasts of 128 .. 1,900 tokens: the portable graph (past in, past + 1 out,
a copy of the whole cache per step) against the decode graph (GroupQueryAttention over in-place slot
buffers). Random token ids, the two paths taking turns, medians of `--steps` steps per round over
`--rounds` rounds. The attention share of each step comes from ONNX Runtime's profiler on a separate
run (kernel time of the GroupQueryAttention nodes), so "the rest" is the step without the attention arithmetic;
"Python around the call" is the decode graph's step minus ONNX Runtime's run inside it.

    .venv/bin/python -m benchmarks.decode.bench_kv_steps --engine engines/smollm2-int4 [--pasts 128,1024,1900]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmarks.common.decode import slot_steps


def padded_steps(backend, past: int, steps: int, rng) -> list[float]:
    from trtserve.runtime import generate

    state = generate.start(backend, 1)
    generate.step(backend, state, rng.integers(0, 1000, (1, past)), last_only=True)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        generate.step(backend, state, np.array([[42]]), last_only=True)
        times.append(time.perf_counter() - started)
    return times


def attention_ms(engine, past: int, steps: int, threads: int) -> float:
    """Kernel time per step of the decode graph's attention nodes, from ONNX Runtime's profiler."""
    import onnxruntime as ort

    from trtserve.runtime.kv_slots import KV_GRAPH, KVSlots

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.log_severity_level = threads, 3
        options.enable_profiling, options.profile_file_prefix = True, os.path.join(tmp, "profile")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(engine.file(KV_GRAPH)), options, providers=["CPUExecutionProvider"])
        slot_steps(KVSlots(engine, 1, threads, session=session), past, steps, np.random.default_rng(0))
        events = json.load(open(session.end_profiling()))
    runs = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run = len(runs) // (steps + 1)
    return sum(e["dur"] for e in runs[per_run:] if e["args"]["op_name"] == "GroupQueryAttention") / steps / 1000


def main() -> None:
    from trtserve.engine_dir import open_engine_dir
    from trtserve.runtime.ort import OrtBackend

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--pasts", default="128,1024,1900")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = open_engine_dir(args.engine)
    backend = OrtBackend(engine, args.threads)
    slots = backend.kv_slots(1)
    if slots is None:
        sys.exit(f"{args.engine} has no decode graph: rebuild it with this trtserve")
    pasts = [int(p) for p in args.pasts.split(",")]
    rng = np.random.default_rng(0)
    samples = {(path, p): [] for path in ("padded", "slots") for p in pasts}
    outside = {p: [] for p in pasts}
    for r in range(args.rounds):
        order = ("padded", "slots") if r % 2 == 0 else ("slots", "padded")
        for past in pasts:
            for path in order:
                times = padded_steps(backend, past, args.steps, rng) if path == "padded" else \
                    slot_steps(slots, past, args.steps, rng, outside[past])
                samples[path, past].append(statistics.median(times) * 1000)
    print(f"engine {args.engine}, batch 1, {args.threads} threads, median of {args.rounds} rounds x {args.steps} steps")
    print("| past | portable graph ms/step | decode graph ms/step | its attention (profiler) | the rest "
          "| Python around the call |")
    print("|---:|---:|---:|---:|---:|---:|")
    rest = {}
    for past in pasts:
        padded, step = statistics.median(samples["padded", past]), statistics.median(samples["slots", past])
        attention = attention_ms(engine, past, args.steps, args.threads)
        rest[past] = step - attention
        print(f"| {past} | {padded:.2f} | {step:.2f} | {attention:.2f} | {rest[past]:.2f} "
              f"| {statistics.median(outside[past]) * 1000:.2f} |")
    first, last = pasts[0], pasts[-1]
    ratio = {path: statistics.median(samples[path, last]) / statistics.median(samples[path, first])
             for path in ("padded", "slots")}
    print(f"past {last} / past {first}: portable graph {ratio['padded']:.2f}x, decode graph {ratio['slots']:.2f}x, "
          f"decode graph without its attention arithmetic {rest[last] / rest[first]:.2f}x")


if __name__ == "__main__":
    main()

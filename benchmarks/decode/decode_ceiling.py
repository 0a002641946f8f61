"""How close a batch-1 decode step comes to what this machine's memory allows: the weight bytes a step must
read against the rate at which ONNX Runtime streams weights here, measured in the same run.

A batch-1 decode step reads every weight of its graph once (an embedding table only for the row it looks up)
plus the KV cache, so it cannot take less than those bytes / the machine's read rate, whatever its arithmetic
costs. The read rate is ONNX Runtime's own fp32 GEMV ([1, 4096] x [4096, 32768], 512 MiB of weights, mapped
like an engine's) with the same threads: the fastest way these kernels stream weights on this machine, so the
ceiling is "as if every GEMM of the step were memory-bound like that one". Rounds interleave the GEMV and each
engine's decode step at `--past` (random ids, medians). On a shared VM the read rate moves from day to day:
compare within one run.

    .venv/bin/python -m benchmarks.decode.decode_ceiling --engine engines/smollm2 \\
        --engine engines/smollm2-int4 [--past 128]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

TABLE_READERS = {"Gather": 0, "GatherBlockQuantized": 0}  # op: the input index of its table
K, N = 4096, 32768


def gemv(folder: Path, threads: int):
    """A session of one fp32 GEMV over 512 MiB of mapped weights, and the call that runs it."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((K, N), dtype=np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
                              [numpy_helper.from_array(weight, "w")])
    path = folder / "gemv.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, location="gemv.onnx.data")
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    x = np.ones((1, K), np.float32)
    return weight.nbytes, lambda: session.run(None, {"x": x})


def step_bytes(graph: Path, past: int) -> tuple[int, int]:
    """(weight bytes a batch-1 decode step reads, KV cache bytes at `past`)."""
    import onnx
    from onnx import helper

    from trtserve.engine_builder.onnxruntime import initializer_bytes

    model = onnx.load(str(graph), load_external_data=False)
    sizes, rows_of = initializer_bytes(model), {t.name: t.dims[0] for t in model.graph.initializer if t.dims}
    tables = {n.input[TABLE_READERS[n.op_type]] for n in model.graph.node if n.op_type in TABLE_READERS}
    rows = sum(sizes[name] // rows_of[name] for name in tables if name in sizes)  # one row each
    weights = sum(size for name, size in sizes.items() if name not in tables) + rows
    kv = 0
    for i in model.graph.input:
        if i.name.startswith("past_key_values."):
            dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
            element = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).itemsize
            kv += dims[1] * dims[3] * past * element  # heads x head size x past, one row
    return weights, kv


def main() -> None:
    from benchmarks.common.decode import slot_steps
    from trtserve.engine_dir import open_engine_dir
    from trtserve.runtime.base import available_cores
    from trtserve.runtime.kv_slots import KV_GRAPH, KVSlots

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", required=True, help="a decoder engine with a decode graph")
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    threads = args.threads or available_cores()
    engines = {}
    for path in args.engine:
        engine = open_engine_dir(path)
        if not engine.file(KV_GRAPH).is_file():
            raise SystemExit(f"{path}: no decode graph ({KV_GRAPH})")
        engines[path] = (engine, KVSlots(engine, 1, threads), step_bytes(engine.file(KV_GRAPH), args.past))
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        nbytes, run = gemv(Path(tmp), threads)
        run()
        read, steps = [], {path: [] for path in engines}
        for _ in range(args.rounds):
            for _ in range(args.steps):
                started = time.perf_counter()
                run()
                read.append(nbytes / (time.perf_counter() - started))
            for path, (_, slots, _) in engines.items():
                steps[path].extend(slot_steps(slots, args.past, args.steps, rng))
    rate = statistics.median(read)
    print(f"weights streamed by ONNX Runtime's fp32 GEMV: {rate / 1e9:.1f} GB/s (median; {threads} threads, "
          f"{args.rounds} rounds of {args.steps} calls, interleaved with the decode steps)")
    print(f"| engine | weights read per step | KV at past {args.past} | ceiling tok/s | measured tok/s | "
          "of the ceiling | bytes/s read |\n|---|---:|---:|---:|---:|---:|---:|")
    for path, (engine, _, (weights, kv)) in engines.items():
        step = statistics.median(steps[path])
        print(f"| {Path(path).name} ({engine.manifest.precision.policy}) | {weights / 1e6:.1f} MB | "
              f"{kv / 1e6:.1f} MB | {rate / (weights + kv):.0f} | {1 / step:.1f} | "
              f"{(weights + kv) / rate / step:.0%} | "
              f"{(weights + kv) / step / 1e9:.1f} GB/s |")


if __name__ == "__main__":
    main()

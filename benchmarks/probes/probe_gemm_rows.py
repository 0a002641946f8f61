"""Which ONNX Runtime CPU kernel is fastest for one SmolLM2-sized GEMM as the rows grow from a decode step's
to a prefill's: fp32 MatMul (MLAS SGEMM), MatMulNBits with 4- and 8-bit weights in blocks of 32 on fp32
activations (accuracy level 0) and on int8 activations (level 4), the level-4 kernels on twice the rows (the
cost of int8 activations with their rounding residual, which keeps the fidelity target), and
DynamicQuantizeMatMul (uint8 activations with one scale per tensor, int8 weights with one scale per column:
the kernel ONNX Runtime's quantize_dynamic uses). Random weights and inputs (speed only), 2 threads, median of
`--runs` calls after a warm-up.

    .venv/bin/python -m benchmarks.probes.probe_gemm_rows [--k 576] [--n 1536] [--rows 1 16 32 128 512]
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.common import timed as median_ms


def _model(nodes, inits, k: int):
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("com.microsoft", 1)])


def models(k: int, n: int, rng) -> dict:
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    weight = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    fp32 = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(weight, "w")], k)
    out = {"fp32 MatMul": fp32}
    for bits in (4, 8):
        for level in (0, 4):
            copy = fp32.__class__.FromString(fp32.SerializeToString())
            config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, accuracy_level=level, bits=bits)
            quantizer = MatMulNBitsQuantizer(copy, algo_config=config)
            quantizer.process()
            out[f"MatMulNBits {bits}-bit, level {level}"] = quantizer.model.model
    codes = rng.integers(-127, 128, (k, n), dtype=np.int8)
    out["DynamicQuantizeMatMul u8s8"] = _model(
        [helper.make_node("DynamicQuantizeMatMul", ["x", "wq", "ws"], ["y"], domain="com.microsoft")],
        [numpy_helper.from_array(codes, "wq"), numpy_helper.from_array(np.full(n, 0.01, np.float32), "ws")], k)
    return out


def timed(session, x, runs: int) -> float:
    """Median ms of one call over `runs`, after one warm-up call."""
    return median_ms(lambda: session.run(None, {"x": x}), 0, runs, warmup=1)


def main() -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 128, 512])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = args.threads, 3
    sessions = {name: ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                for name, m in models(args.k, args.n, rng).items()}
    doubled = [name for name in sessions if name.endswith("level 4")]
    columns = list(sessions) + [f"{name}, 2x rows" for name in doubled]
    print(f"ms per call, {args.k} -> {args.n}, {args.threads} threads, median of {args.runs}")
    print("| rows | " + " | ".join(columns) + " |\n|---:|" + "---:|" * len(columns))
    for rows in args.rows:
        x = rng.standard_normal((rows, args.k)).astype(np.float32)
        x2 = rng.standard_normal((2 * rows, args.k)).astype(np.float32)
        cells = ([timed(s, x, args.runs) for s in sessions.values()]
                 + [timed(sessions[n], x2, args.runs) for n in doubled])
        print(f"| {rows} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    flops = 2 * args.k * args.n * max(args.rows)
    fp32 = timed(sessions["fp32 MatMul"], rng.standard_normal((max(args.rows), args.k)).astype(np.float32), args.runs)
    print(f"fp32 MatMul at {max(args.rows)} rows: {flops / fp32 / 1e6:.0f} GFLOP/s")


if __name__ == "__main__":
    main()

"""How ONNX Runtime can run a GEMM whose 4-bit blocks carry a float minimum (GGUF Q4_1: w = d*q + m per block
of 32), timed on one SmolLM2-sized GEMM with random blocks against the fp32 product of the same weights:

- "float zero points": one MatMulNBits with zero points of the scales' type (zp = -m/d), which the
  operator's schema allows;
- "codes + minimum GEMM" (what trtserve's graphs hold): MatMulNBits on the codes with the default zero
  point 8, plus the per-block sums of the input times the minima (m + 8d) in a small fp32 MatMul, added;
- "codes only": MatMulNBits alone (wrong output), the floor the minimum's cost is measured from.

Each at accuracy level 0 (fp32 activations) and 4 (int8 activations), M rows of input, 2 threads,
median of `--runs` calls after a warm-up.

    .venv/bin/python -m benchmarks.probes.probe_block_minimum [--k 1536] [--n 576] [--rows 1 16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

BLOCK = 32


def graph(k: int, n: int, packed, scales, level: int, form: str, minimum=None, zero=None) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(packed, "codes"), numpy_helper.from_array(scales.reshape(-1), "scales")]
    inputs = ["x", "codes", "scales"]
    if form == "float zero points":
        inits.append(numpy_helper.from_array(zero.reshape(-1), "zero"))
        inputs.append("zero")
    out = "y" if form != "codes + minimum GEMM" else "codes_y"
    nodes = [helper.make_node("MatMulNBits", inputs, [out], domain="com.microsoft", K=k, N=n, bits=4,
                              block_size=BLOCK, accuracy_level=level)]
    if form == "codes + minimum GEMM":
        inits += [numpy_helper.from_array(np.array([0, k // BLOCK, BLOCK], np.int64), "blocks"),
                  numpy_helper.from_array(np.array([-1], np.int64), "last"),
                  numpy_helper.from_array(np.ascontiguousarray(minimum.T), "minimum")]
        nodes += [helper.make_node("Reshape", ["x", "blocks"], ["xb"]),
                  helper.make_node("ReduceSum", ["xb", "last"], ["sums"], keepdims=0),
                  helper.make_node("MatMul", ["sums", "minimum"], ["shift"]),
                  helper.make_node("Add", ["codes_y", "shift"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def main() -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--n", type=int, default=576)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    k, n = args.k, args.n
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = (rng.random((n, k // BLOCK)) * 0.01 + 0.001).astype(np.float32)
    m = (-rng.random((n, k // BLOCK)) * 0.08).astype(np.float32)
    weight = (q.reshape(n, k // BLOCK, BLOCK) * d[..., None] + m[..., None]).reshape(n, k)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, k // BLOCK, BLOCK // 2)
    print(f"one {k} -> {n} GEMM in Q4_1 blocks of {BLOCK}, ONNX Runtime {ort.__version__}, 2 threads, "
          f"median of {args.runs} calls")
    print("| form | accuracy level | rows | µs per call | max abs error / max abs output |\n|---|---|---:|---:|---:|")
    for form in ("float zero points", "codes + minimum GEMM", "codes only"):
        for level in (0, 4):
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.log_severity_level = 2, 3
            session = ort.InferenceSession(graph(k, n, packed, d, level, form, minimum=m + 8 * d, zero=-m / d),
                                           options, providers=["CPUExecutionProvider"])
            for rows in args.rows:
                x = rng.standard_normal((rows, k)).astype(np.float32)
                y = session.run(None, {"x": x})[0]
                reference = x @ weight.T
                times = []
                for _ in range(args.runs):
                    start = time.perf_counter()
                    session.run(None, {"x": x})
                    times.append(time.perf_counter() - start)
                error = float(np.abs(y - reference).max() / np.abs(reference).max())
                print(f"| {form} | {level} | {rows} | {np.median(times) * 1e6:.0f} | {error:.1e} |")


if __name__ == "__main__":
    main()

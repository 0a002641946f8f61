"""Int8 activations with their rounding residual (engine_builder/activation_residual.py) on ONNX Runtime's real
MatMulNBits kernel with 8-bit weights: the rewritten call computes round(x) @ W + round(x - round(x)) @ W, with the
kernel's own rounding (blocks of 32 by their largest magnitude), and so comes far closer to the fp32 product than
int8 alone; a bias is added once; the lowering undoes exactly."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trtserve.engine_builder.activation_residual import add_residual_rows, residual_gemms

K, N = 128, 64


def _gemm_model(codes, scales, level: int, names=("a", "b"), bias=None):
    """Two 8-bit GEMMs reading one input (the second with `bias`, if given), a third reading the first's output."""
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales"),
             numpy_helper.from_array(codes[:, : N // 32].copy(), "codes2"),
             numpy_helper.from_array(scales.reshape(N, -1)[:, : N // 32].ravel().copy(), "scales2")]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))

    def gemm(name, x, y, k, b, s, extra=()):
        return helper.make_node("MatMulNBits", [x, b, s, *extra], [y], name=name, domain="com.microsoft", K=k, N=N,
                                bits=8, block_size=32, accuracy_level=level)

    nodes = [gemm(names[0], "x", "y0", K, "codes", "scales"),
             gemm(names[1], "x", "y1", K, "codes", "scales", ("", "", "bias") if bias is not None else ()),
             gemm("c", "y0", "y2", N, "codes2", "scales2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", K])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["b", "s", N])
                               for y in ("y1", "y2")],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _run(model, x):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def _weights():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(N, K // 32, 32), dtype=np.uint8)
    scales = (rng.random((N, K // 32), dtype=np.float32) * 0.01 + 0.001).ravel()
    dense = ((codes.astype(np.float32) - 128) * scales.reshape(N, K // 32, 1)).reshape(N, K)  # no zero point: 128
    return codes, scales, dense


def _int8_blocks(x):
    blocks = x.reshape(-1, 32).astype(np.float64)
    scale = np.abs(blocks).max(-1, keepdims=True) / 127
    scale = np.where(scale > 0, scale, 1.0)
    return (np.round(blocks / scale) * scale).reshape(x.shape)


def test_residual_rows_compute_both_roundings_through_the_same_weights():
    codes, scales, dense = _weights()
    rng = np.random.default_rng(1)
    # channels of very different magnitudes, as a residual stream has: plain int8 loses the small ones
    x = (rng.standard_normal((2, 5, K)) * np.exp(2 * rng.standard_normal(K))).astype(np.float32)
    exact = _run(_gemm_model(codes, scales, 0), x)[0]
    int8 = _run(_gemm_model(codes, scales, 4), x)[0]
    model = _gemm_model(codes, scales, 4)
    assert add_residual_rows(model, {"a", "b"}) == {"a", "b"}
    assert residual_gemms(model) == {"a", "b"}
    assert not add_residual_rows(model, {"a", "b"})  # once only
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Concat") == 1 and ops.count("Split") == 2  # one residual for the two readers of x
    got = _run(model, x)[0]
    assert got.shape == exact.shape
    rounded = _int8_blocks(x)
    want = rounded @ dense.T + _int8_blocks(x - rounded) @ dense.T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    largest = np.abs(exact).max()
    assert np.abs(got - exact).max() < np.abs(int8 - exact).max() / 50
    assert np.abs(got - exact).max() < 1e-3 * largest


def test_only_the_named_gemms_and_any_input_shape():
    codes, scales, _ = _weights()
    model = _gemm_model(codes, scales, 4)
    assert add_residual_rows(model, {"c"}) == {"c"} and residual_gemms(model) == {"c"}
    onnx.checker.check_model(model)
    for shape in ((1, 1, K), (3, 7, K)):
        x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
        outputs = _run(model, x)
        assert outputs[1].shape == shape[:2] + (N,) and np.isfinite(outputs[1]).all()
    zeros = _run(model, np.zeros((1, 2, K), np.float32))
    assert all(np.all(o == 0) for o in zeros)  # an all-zero block: no division by zero
    assert not add_residual_rows(_gemm_model(codes, scales, 4), set())


def test_rounded_activations_are_undone_exactly():
    """The decode-graph check compares graphs without their roundings: undoing them gives back the fp32-activation
    graph's numbers, a shared residual and a bias included."""
    from trtserve.engine_builder.activation_residual import activation_lowerings, without_rounded_activations

    codes, scales, _ = _weights()
    bias = np.linspace(-1, 1, N, dtype=np.float32)
    x = np.random.default_rng(3).standard_normal((1, 3, K)).astype(np.float32)
    exact = _run(_gemm_model(codes, scales, 0, bias=bias), x)
    model = _gemm_model(codes, scales, 4, bias=bias)
    add_residual_rows(model, {"a", "b"})
    assert activation_lowerings(model) == {"a": (4, True), "b": (4, True), "c": (4, False)}
    assert without_rounded_activations(model) and not residual_gemms(model)
    assert not any(".residual" in n.name for n in model.graph.node)
    assert not any(i.name.startswith("residual.") for i in model.graph.initializer)
    assert list(next(n for n in model.graph.node if n.name == "b").input)[5] == "bias"
    for got, want in zip(_run(model, x), exact):
        np.testing.assert_array_equal(got, want)
    assert not without_rounded_activations(model)  # nothing left to undo


def test_a_bias_is_added_once_and_4_bit_weights_keep_fp32_activations():
    codes, scales, dense = _weights()
    bias = np.linspace(-1, 1, N, dtype=np.float32)
    x = np.random.default_rng(5).standard_normal((2, 4, K)).astype(np.float32)
    exact = _run(_gemm_model(codes, scales, 0, bias=bias), x)[0]
    model = _gemm_model(codes, scales, 4, bias=bias)
    add_residual_rows(model, "*")
    got = _run(model, x)[0]
    np.testing.assert_allclose(got, x @ dense.T + bias, rtol=1e-3, atol=1e-3 * np.abs(exact).max())
    assert np.abs(got - exact).max() < 1e-3 * np.abs(exact).max()
    four_bit = onnx.helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], name="q4", domain="com.microsoft", K=K,
                                     N=N, bits=4, block_size=32)
    from trtserve.engine_builder.activation_residual import takes_residual

    assert not takes_residual(four_bit)

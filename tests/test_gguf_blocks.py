"""The gguf policy on a tiny GGUF file and a tiny graph made here: blocks read exactly as gguf-py
dequantizes them, matched to graph weights by their rows (in any order), written as standard ONNX
that the checker accepts, ONNX Runtime fuses into MatMulNBits and computes like the fp32 graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

gguf = pytest.importorskip("gguf", reason="the gguf package (installed by scripts/setup.sh) reads GGUF files")
from gguf.quants import dequantize, quantize  # noqa: E402

from trtserve.precision.activations import lm_head, plans  # noqa: E402
from trtserve.precision.gguf_blocks import BlockIndex, read_blocks  # noqa: E402
from trtserve.precision.gguf_policy import KEPT, apply_gguf  # noqa: E402

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
HIDDEN, FFN, VOCAB = 64, 96, 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A GGUF with an embedding (Q8_0) and two GEMM weights (Q4_1), and the fp32 graph an exporter
    would make from its dequantized weights: embedding -> up -> down -> tied LM head (Transpose)."""
    rng = np.random.default_rng(0)
    arrays = {"token_embd.weight": (rng.standard_normal((VOCAB, HIDDEN)), Q8_0),
              "blk.0.ffn_up.weight": (rng.standard_normal((FFN, HIDDEN)), Q4_1),
              "blk.0.ffn_gate.weight": (rng.standard_normal((FFN, HIDDEN)), Q4_1),
              "blk.0.ffn_down.weight": (rng.standard_normal((HIDDEN, FFN)), Q4_1)}
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rows = {}
    for name, (values, qtype) in arrays.items():
        packed = quantize(values.astype(np.float32), qtype)
        writer.add_tensor(name, packed, raw_dtype=qtype)
        rows[name] = dequantize(packed, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    order = np.random.default_rng(1).permutation(FFN)  # rows reordered, as transformers does to q/k heads
    inits = {"embed": rows["token_embd.weight"], "up": rows["blk.0.ffn_up.weight"][order].T.copy(),
             "gate": rows["blk.0.ffn_gate.weight"].T.copy(),
             "down": rows["blk.0.ffn_down.weight"].T.copy(),
             "extra": rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32),
             "odd": rng.standard_normal((HIDDEN, 33)).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h0"], name="embedding"),
             helper.make_node("MatMul", ["h0", "up"], ["h1u"], name="up_proj"),
             helper.make_node("MatMul", ["h0", "gate"], ["h1g"], name="gate_proj"),
             helper.make_node("Mul", ["h1u", "h1g"], ["h1"], name="glu"),
             helper.make_node("MatMul", ["h1", "down"], ["h2"], name="down_proj"),
             helper.make_node("MatMul", ["h2", "extra"], ["h3"], name="not_in_gguf"),
             helper.make_node("MatMul", ["h3", "odd"], ["side"], name="other_width"),
             helper.make_node("Transpose", ["embed"], ["embed_t"], name="tie", perm=[1, 0]),
             helper.make_node("MatMul", ["h3", "embed_t"], ["logits"], name="lm_head")]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "S"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", VOCAB]),
         helper.make_tensor_value_info("side", TensorProto.FLOAT, ["B", "S", 33])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    return path, model


def _run(model, ids, graph_level="all"):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if graph_level == "all"
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})


def test_blocks_dequantize_as_gguf_py_does(tiny):
    path, _ = tiny
    reader = gguf.GGUFReader(str(path))
    blocks = {b.name: b for b in read_blocks(path)}
    for tensor in reader.tensors:
        assert np.array_equal(blocks[tensor.name].dequantized(), dequantize(tensor.data, tensor.tensor_type))
    assert blocks["token_embd.weight"].minimum is None and blocks["blk.0.ffn_up.weight"].minimum is not None


def test_rows_are_matched_in_any_order_and_never_partly(tiny):
    path, model = tiny
    index = BlockIndex(read_blocks(path))
    up = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "up")).T
    assert np.array_equal(index.match(up).dequantized(), up)
    mixed = up.copy()
    mixed[3] += 1e-3  # one row that no GGUF tensor holds
    assert index.match(mixed) is None


def test_graph_carries_the_blocks_and_computes_what_the_fp32_graph_does(tiny, tmp_path):
    path, fp32 = tiny
    model, report = apply_gguf(onnx.ModelProto.FromString(fp32.SerializeToString()), path)
    onnx.checker.check_model(model, full_check=True)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 21
    assert {k: v["format"] for k, v in report["gemms"].items()} == {
        "up_proj": "Q4_1", "gate_proj": "Q4_1", "down_proj": "Q4_1", "lm_head": "Q8_0"}
    assert report["gemms"]["gate_proj"]["computed_with"] == ["up_proj", "gate_proj"]  # one input: one GEMM
    assert "computed_with" not in report["gemms"]["down_proj"]
    assert report["embeddings"]["embedding"]["format"] == "Q8_0"
    assert set(report["fp32"]) == {"not_in_gguf", "other_width"}
    types = {i.name: i.data_type for i in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert sorted(types[n.input[0]] for n in dq) == sorted([TensorProto.INT4, TensorProto.INT4,
                                                            TensorProto.INT8, TensorProto.INT8])
    assert all(helper.get_attribute_value(next(a for a in n.attribute if a.name == "block_size")) == 32 for n in dq)
    assert not {"embed", "up", "down"} & set(types), "the fp32 copies of carried weights are gone"
    ids = np.random.default_rng(2).integers(0, VOCAB, (2, 5))
    want = _run(fp32, ids)
    for level in ("none", "all"):  # the plain DequantizeLinear graph, then ONNX Runtime's fused one
        got = _run(model, ids, level)
        for a, b in zip(want, got):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * np.abs(a).max())


def test_onnx_runtime_fuses_every_carried_gemm(tiny, tmp_path):
    import onnxruntime as ort

    path, fp32 = tiny
    model, _ = apply_gguf(onnx.ModelProto.FromString(fp32.SerializeToString()), path)
    onnx.save(model, str(tmp_path / "m.onnx"))
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "m.ort.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(tmp_path / "m.onnx"), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "m.ort.onnx")).graph.node]
    assert ops.count("MatMulNBits") == 3 and ops.count("DequantizeLinear") == 1  # the table: see build_ort


def test_kept_gemms_keep_fp32_weights(tiny):
    path, fp32 = tiny
    model, report = apply_gguf(onnx.ModelProto.FromString(fp32.SerializeToString()), path, keep=frozenset({"lm_head"}))
    assert report["fp32"]["lm_head"] == KEPT and "lm_head" not in report["gemms"]
    assert lm_head(fp32) == "lm_head"
    assert plans(fp32)[-1].fp32_weights == frozenset({"lm_head"})


def test_onnx_runtime_lowerings_in_the_optimized_graph_only(tiny, tmp_path):
    """Per-node accuracy levels, and the embedding as GatherBlockQuantized, computing the same numbers."""
    from trtserve.engine_builder.onnxruntime import OPTIMIZED, build_ort

    path, fp32 = tiny
    model, _ = apply_gguf(onnx.ModelProto.FromString(fp32.SerializeToString()), path)
    onnx.save(model, str(tmp_path / "model.onnx"))
    entry = build_ort(tmp_path / "model.onnx", tmp_path, frozenset({"lm_head"}))
    assert entry["matmulnbits_accuracy_levels"] == {"0": 2, "4": 1}
    levels = {n.name: helper.get_attribute_value(next(a for a in n.attribute if a.name == "accuracy_level"))
              for n in onnx.load(str(tmp_path / OPTIMIZED)).graph.node if n.op_type == "MatMulNBits"}
    assert levels == {"up_proj": 0, "down_proj": 0, "lm_head": 4}
    lowered = onnx.load(str(tmp_path / OPTIMIZED))
    assert [n.op_type for n in lowered.graph.node].count("GatherBlockQuantized") == 1
    assert "DequantizeLinear" not in [n.op_type for n in lowered.graph.node]
    ids = np.random.default_rng(3).integers(0, VOCAB, (2, 5))
    want = _run(model, ids, "none")[1]  # `side` reads the embedding through fp32 GEMMs only
    np.testing.assert_allclose(_run(lowered, ids, "none")[1], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not any(a.name == "accuracy_level" for n in onnx.load(str(tmp_path / "model.onnx")).graph.node
                   for a in n.attribute)


def test_residual_rows_are_an_optimized_graph_lowering_for_8_bit_weights(tiny, tmp_path):
    """The plans' residual form: the 8-bit GEMMs outside the int8 set (here the tied LM head on the Q8_0 table)
    run on the int8 kernel with their rounding residual, the 4-bit ones on fp32 activations; only the optimized
    graph holds it, and its logits are far closer to the fp32 graph's than an int8 head's."""
    from trtserve.engine_builder.activation_residual import residual_gemms
    from trtserve.engine_builder.onnxruntime import OPTIMIZED, build_ort

    path, fp32 = tiny
    model, _ = apply_gguf(onnx.ModelProto.FromString(fp32.SerializeToString()), path)
    onnx.save(model, str(tmp_path / "model.onnx"))
    ids = np.random.default_rng(4).integers(0, VOCAB, (2, 6))
    exact = _run(model, ids, "none")[0]
    logits, entries = {}, {}
    for label, int8, residual in (("int8", frozenset({"lm_head"}), frozenset()),
                                  ("residual", frozenset(), frozenset("*"))):
        out = tmp_path / label
        out.mkdir()
        entries[label] = build_ort(tmp_path / "model.onnx", out, int8, residual)["matmulnbits_accuracy_levels"]
        lowered = onnx.load(str(out / OPTIMIZED))
        logits[label] = _run(lowered, ids, "none")[0]
    assert entries == {"int8": {"0": 2, "4": 1}, "residual": {"0": 2, "4+residual": 1}}
    assert residual_gemms(lowered) == {"lm_head"}
    assert plans(fp32)[3].fast == frozenset("*") and not plans(fp32)[3].fp32_weights
    error = {k: np.abs(v - exact).max() for k, v in logits.items()}
    assert error["residual"] < error["int8"] / 30, error


def test_tensorrt_rtx_parses_the_carried_graph(tiny, tmp_path):
    trt = pytest.importorskip("tensorrt_rtx", reason="pip install tensorrt-rtx-cu13 (parses ONNX without a GPU)")
    path, fp32 = tiny
    model, _ = apply_gguf(onnx.ModelProto.FromString(fp32.SerializeToString()), path)
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    ok = parser.parse(model.SerializeToString())
    assert ok, [parser.get_error(i).desc() for i in range(parser.num_errors)]
    kinds = {network.get_layer(i).type for i in range(network.num_layers)}
    assert trt.LayerType.DEQUANTIZE in kinds and trt.LayerType.MATRIX_MULTIPLY in kinds

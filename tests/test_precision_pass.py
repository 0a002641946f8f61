"""The precision pass, read back from the graph it writes and run in ONNX Runtime."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from tests.onnx_graphs import block_graph, rotary_graph
from trtserve.precision.passes import apply_policy, emulation_model, find_patterns
from trtserve.precision.policy import get_policy

HALF, FLOAT = TensorProto.FLOAT16, TensorProto.FLOAT


def tensor_types(model):
    model = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.input)
             + list(model.graph.output)}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    return types


def input_types(model, op_type):
    types = tensor_types(model)
    return [[types.get(i) for i in n.input] for n in model.graph.node if n.op_type == op_type]


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def block_feeds(batch=2, seq=5, scale=1.0):
    rng = np.random.default_rng(1)
    mask = np.ones((batch, seq), np.int64)
    mask[1, :2] = 0
    return {"x": (rng.normal(size=(batch, seq, 16)) * scale).astype(np.float32), "attention_mask": mask}


def test_patterns_are_found_by_structure():
    found = find_patterns(block_graph(), ("rmsnorm", "attention_mask"))
    assert len(found["rmsnorm"]) == 1 and len(found["rmsnorm"][0]) == 7  # Pow .. weight Mul
    assert len(found["attention_mask"]) == 1
    rotary = find_patterns(rotary_graph(), ("rotary",))["rotary"]
    assert len(rotary) == 1 and len(rotary[0]) >= 5  # Unsqueeze, Cast, Mul, Concat, Cos, Sin


def test_hybrid_puts_gemms_in_fp16_and_keeps_the_rest_fp32():
    mixed, report = apply_policy(block_graph(), get_policy("hybrid"))
    onnx.checker.check_model(mixed, full_check=True)
    for inputs in input_types(mixed, "MatMul"):
        assert inputs == [HALF, HALF]
    for op in ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax"):
        assert all(t == FLOAT for inputs in input_types(mixed, op) for t in inputs if t in (HALF, FLOAT)), op
    inits = {i.name: i.data_type for i in mixed.graph.initializer}
    assert inits["wq"] == inits["wk"] == inits["wo"] == HALF
    assert inits["norm_w"] == inits["eps"] == inits["mask_min"] == FLOAT
    assert [v.type.tensor_type.elem_type for v in mixed.graph.output] == [FLOAT]
    assert report.patterns["rmsnorm"]["instances"] == 1


def test_no_round_trips_between_adjacent_fp32_nodes():
    mixed, _ = apply_policy(block_graph(), get_policy("hybrid"))
    producers = {out: n for n in mixed.graph.node for out in n.output}
    for node in mixed.graph.node:
        if node.op_type == "Cast":
            source = producers.get(node.input[0])
            assert source is None or source.op_type != "Cast", f"{source.name} -> {node.name} is a cast round trip"
    casts = [(n.input[0], n.attribute[0].i) for n in mixed.graph.node if n.op_type == "Cast"]
    assert len(casts) == len(set(casts))  # one Cast per (tensor, type), shared by its consumers


def test_constants_are_never_clamped():
    """fp32's minimum does not fit fp16: the node reading it stays fp32 and the value is exact."""
    mixed, report = apply_policy(block_graph(), get_policy("fp16"))
    onnx.checker.check_model(mixed, full_check=True)
    value = numpy_helper.to_array(next(i for i in mixed.graph.initializer if i.name == "mask_min"))
    assert value.dtype == np.float32 and value == np.finfo(np.float32).min
    assert any("Where" in name for name in report.kept_fp32_unrepresentable)


def test_hybrid_runs_close_to_fp32():
    feeds = block_feeds()
    ref = run(block_graph(), feeds)
    mixed, _ = apply_policy(block_graph(), get_policy("hybrid"))
    out = run(mixed, feeds)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    cos = float((ref * out).sum() / np.linalg.norm(ref) / np.linalg.norm(out))
    assert cos > 0.9999


def test_emulation_shows_fp16_overflow_that_onnxruntime_hides():
    """Inputs near 300 square to 90,000 > 65,504: in fp16 the RMSNorm's mean overflows to inf, its
    reciprocal square root to 0, and the block's output collapses; hybrid's fp32 chain does not."""
    feeds = block_feeds(scale=300.0)
    x = feeds["x"]
    ref = run(block_graph(), feeds) - x  # what the block adds to the residual stream

    def cosine(out):
        delta = out - x
        return float((ref * delta).sum() / np.linalg.norm(ref) / np.linalg.norm(delta))

    fp16 = get_policy("fp16")
    mixed, _ = apply_policy(block_graph(), fp16)
    assert cosine(run(mixed, feeds)) > 0.999  # ORT on the CPU computes the fp16 Pow in fp32
    assert cosine(run(emulation_model(block_graph(), fp16), feeds)) < 0.5
    assert cosine(run(emulation_model(block_graph(), get_policy("hybrid")), feeds)) > 0.999


def test_emulation_of_fp32_is_the_original_graph():
    feeds = block_feeds()
    assert np.array_equal(run(emulation_model(block_graph(), get_policy("fp32")), feeds), run(block_graph(), feeds))


def rotary_error(policy_name, positions):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, len(positions), 64)).astype(np.float32)
    feeds = {"q": q, "position_ids": np.array([positions], np.int64)}
    ref = run(rotary_graph(), feeds)
    out = run(emulation_model(rotary_graph(), get_policy(policy_name)), feeds)
    cos = (ref * out).sum(-1) / np.linalg.norm(ref, axis=-1) / np.linalg.norm(out, axis=-1)
    return float(cos.min())


def test_fp16_rotary_angle_fails_at_long_positions_and_hybrid_avoids_it():
    long_positions = list(range(1024, 2048))
    assert rotary_error("fp16", list(range(0, 64))) > 0.999  # short positions hide the problem
    assert rotary_error("fp16", long_positions) < 0.99  # the angle pos*inv_freq rounded in fp16
    assert rotary_error("hybrid", long_positions) > 0.99999


@pytest.mark.parametrize("policy", ["fp16", "hybrid"])
def test_initializers_of_fp16_nodes_halve_the_weight_bytes(policy):
    mixed, _ = apply_policy(block_graph(), get_policy(policy))
    weights = {i.name: i for i in mixed.graph.initializer if i.name in ("wq", "wk", "wo")}
    assert all(w.data_type == HALF and len(w.raw_data) == 16 * 16 * 2 for w in weights.values())

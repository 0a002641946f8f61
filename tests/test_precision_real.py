"""Hybrid precision on the real bundled models: the graph the pass wrote, and its measured fidelity."""

import json
from collections import Counter

import onnx
import pytest
from onnx import TensorProto

from tests.test_precision_pass import tensor_types

pytestmark = pytest.mark.models
HALF, FLOAT = TensorProto.FLOAT16, TensorProto.FLOAT


def manifest(path):
    return json.loads((path / "manifest.json").read_text())


@pytest.mark.parametrize("key", ["minilm", "smollm2"])
def test_hybrid_meets_the_target_as_served_and_under_emulation(hybrid_engines, key):
    fidelity = manifest(hybrid_engines[key])["fidelity"]
    assert fidelity["passed"], fidelity["failures"]
    for run in ("onnxruntime", "fp16_emulation"):
        for case in fidelity[run]["cases"].values():
            for tensor in [v for v in case.values() if isinstance(v, dict) and "cosine" in v]:
                assert tensor["cosine"] >= 0.9998 and tensor["worst_row_cosine"] >= 0.999
                assert tensor["nonfinite"] == 0
            if "top1_agreement" in case:
                assert case["top1_agreement"] >= 0.995 and case["perplexity_rel_delta"] <= 0.005


def test_smollm2_hybrid_graph_types(hybrid_engines):
    m = manifest(hybrid_engines["smollm2"])
    patterns = m["precision"]["graph"]["patterns_kept_fp32"]
    assert patterns["rmsnorm"]["instances"] == 61  # 2 per layer x 30 + the final norm
    assert patterns["rotary"]["instances"] == 1
    model = onnx.load(str(hybrid_engines["smollm2"] / "model.onnx"))
    types = tensor_types(model)
    by_op = {}
    for node in model.graph.node:
        dtypes = {types.get(i) for i in node.input if types.get(i) in (HALF, FLOAT)}
        by_op.setdefault(node.op_type, Counter()).update(dtypes)
    assert set(by_op["MatMul"]) == {HALF}
    for op in ("Softmax", "Pow", "ReduceMean", "Sqrt", "Reciprocal", "Cos", "Sin"):
        assert set(by_op[op]) == {FLOAT}, op
    assert {v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)} <= {
        FLOAT, TensorProto.INT64}


@pytest.mark.parametrize("key", ["minilm", "smollm2"])
def test_hybrid_engine_file_is_about_half_of_fp32(engines, hybrid_engines, key):
    fp32 = manifest(engines[key])["files"]["model.onnx"]["size"]
    hybrid = manifest(hybrid_engines[key])["files"]["model.onnx"]["size"]
    assert 0.45 < hybrid / fp32 < 0.55, (hybrid, fp32)

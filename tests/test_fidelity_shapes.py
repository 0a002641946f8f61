"""The fidelity gate's shapes beyond real text (random ids, batch 8, padded rows), how random-id cases are
judged, and the one-pass metrics and light shape inference the gate runs on (fast, no model)."""

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtserve.precision import fidelity
from trtserve.precision.measure import Target, _wide_rows, failures, wide_shapes
from trtserve.precision.run import worst


def test_one_pass_compare_equals_the_separate_metrics_across_chunks():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(2, 11, 7)).astype(np.float32)
    out = ref + rng.normal(size=ref.shape).astype(np.float32) * 0.1
    out[1, 4] *= -1
    metrics = fidelity.compare(ref, out, rows=3)  # 22 rows in chunks of 3
    assert metrics["max_abs_error"] == pytest.approx(fidelity.max_abs_error(ref, out), rel=1e-12)
    assert metrics["cosine"] == pytest.approx(fidelity.cosine(ref, out), rel=1e-12)
    assert metrics["worst_row_cosine"] == pytest.approx(fidelity.worst_row_cosine(ref, out), rel=1e-12)
    assert metrics["worst_row_cosine"] < 0
    out[0, 9, 2] = np.nan
    bad = fidelity.compare(ref, out, rows=3)
    assert np.isnan(bad["worst_row_cosine"]) and np.isnan(bad["cosine"]) and np.isnan(bad["max_abs_error"])
    assert bad["nonfinite"] == 1
    assert fidelity.compare(np.zeros((0, 4)), np.zeros((0, 4)))["worst_row_cosine"] == 1.0


def test_row_by_row_perplexity_equals_the_whole_batch_formula():
    rng = np.random.default_rng(2)
    logits, ids = rng.normal(size=(3, 9, 30)), rng.integers(0, 30, (3, 9))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    x = logits[:, :-1]
    log_z = np.log(np.exp(x).sum(-1))
    picked = np.take_along_axis(x, ids[:, 1:, None], -1)[..., 0]
    valid = (mask[:, 1:] * mask[:, :-1]).astype(bool)
    assert fidelity.perplexity(logits, ids, mask) == pytest.approx(np.exp((log_z - picked)[valid].mean()), rel=1e-12)


def test_wide_shapes_are_random_ids_at_batch_1_and_8_and_real_text_at_batch_8():
    assert wide_shapes([32, 128, 512, 2048], 32) == [
        ("random", 1, 32), ("random", 1, 128), ("random", 1, 512), ("random", 1, 2048),
        ("random", 8, 32), ("random", 8, 128), ("real", 8, 128)]
    assert wide_shapes([32, 64], 4) == [("random", 1, 32), ("random", 1, 64), ("random", 4, 32), ("random", 4, 64),
                                        ("real", 4, 32)]
    assert wide_shapes([32], 1) == [("random", 1, 32)]


@pytest.mark.parametrize("left", [True, False])
def test_wide_rows_pad_half_the_batch_by_different_amounts(left):
    backend = SimpleNamespace(engine=SimpleNamespace(manifest=SimpleNamespace(
        model=SimpleNamespace(architecture=SimpleNamespace(vocab_size=5000)))))
    tokenizer = SimpleNamespace(pad_token_id=3)
    ids, mask = _wide_rows(backend.engine, tokenizer, None, "random", 8, 64, left=left)
    assert ids.shape == mask.shape == (8, 64) and ids.dtype == np.int64
    assert mask[:4].all() and ids[:4].min() >= 1000 and ids.max() < 5000
    assert [int((1 - mask[r]).sum()) for r in range(4, 8)] == [8, 16, 32, 48]
    for r in range(4, 8):
        pad = int((1 - mask[r]).sum())
        span = slice(0, pad) if left else slice(64 - pad, 64)
        assert (mask[r, span] == 0).all() and (ids[r, span] == 3).all()
    again, _ = _wide_rows(backend.engine, tokenizer, None, "random", 8, 64, left=left)
    assert np.array_equal(ids, again)  # the same ids on every run: the gate is reproducible


def _case(token_cosine, kind=None, top1=None):
    case = {"logits": {"cosine": 0.99999, "worst_row_cosine": token_cosine, "max_abs_error": 0.1, "nonfinite": 0}}
    if kind:
        case["input"] = kind
    if top1 is not None:
        case.update(top1_agreement=top1, perplexity_rel_delta=0.0)
    return case


def test_random_id_cases_are_judged_by_their_own_token_bound_and_named_in_the_failure():
    report = {"cases": {"seq32": _case(0.9995, top1=1.0), "random b8 seq32": _case(0.995, "random"),
                        "real b8 seq128": _case(0.9995, "real", top1=0.996)}}
    assert failures(report, Target()) == []
    report["cases"]["random b8 seq64"] = _case(-0.8, "random")
    assert failures(report, Target()) == ["random b8 seq64 logits: worst-token cosine -0.800000 < 0.99"]
    strict = failures(report, Target.parse("random_token_cosine=0.999"))
    assert [f.split(":")[0] for f in strict] == ["random b8 seq32 logits", "random b8 seq64 logits"]
    report["cases"]["random b8 seq64"] = _case(0.995, "random")
    report["cases"]["random b8 seq64"]["logits"]["cosine"] = 0.9992  # below min_cosine, above the random bound
    assert failures(report, Target()) == []
    report["cases"]["random b8 seq64"]["logits"]["cosine"] = 0.98
    assert failures(report, Target()) == ["random b8 seq64 logits: cosine 0.980000 < 0.99"]
    report["cases"]["random b8 seq64"] = _case(-0.8, "random")
    report["cases"]["real b8 seq128"]["top1_agreement"] = 0.9939
    assert "real b8 seq128: top-1 agreement 0.9939 < 0.995" in failures(report, Target())
    assert "real b8 seq128" not in " ".join(failures(report, Target.for_weights("float", "decoder")))
    summary = worst(report)
    assert summary["token_cosine"] == 0.9995 and summary["random_token_cosine"] == -0.8
    assert summary["top1"] == 0.9939


def test_targets_by_policy():
    assert Target.for_weights("float", "decoder").min_top1 == 0.99  # fp16, hybrid, auto
    assert Target.for_weights("gguf", "decoder").min_top1 == 0.995
    assert Target.for_weights("float", "encoder") == Target()
    assert Target.parity().random_token_cosine == 0.9999
    assert Target().random_token_cosine == 0.99
    assert Target.for_weights("int4", "decoder").random_token_cosine == 0.8  # never above the real-text bound


def _graph_with_a_large_weight():
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(size=(256, 300)).astype(np.float32), "w")  # 300 KB
    shape = numpy_helper.from_array(np.array([0, -1, 30], np.int64), "shape")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["z"]),
             helper.make_node("Relu", ["z"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 256])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], [weight, shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_light_shape_inference_equals_onnx_and_keeps_the_weights():
    from trtserve.precision.passes import infer_shapes

    model = _graph_with_a_large_weight()
    expected = onnx.shape_inference.infer_shapes(model, data_prop=True)
    got = infer_shapes(model, data_prop=True)
    assert got.SerializeToString() == expected.SerializeToString()
    assert not model.graph.value_info  # the input is not modified
    assert numpy_helper.to_array(got.graph.initializer[0]).shape == (256, 300)
    stale = onnx.ModelProto()
    stale.CopyFrom(expected)
    stale.graph.value_info[0].type.tensor_type.elem_type = TensorProto.DOUBLE  # left over from before a rewrite
    assert infer_shapes(stale, in_place=True) is stale
    assert stale.SerializeToString() == expected.SerializeToString()


def test_a_confirm_grid_gives_the_evaluation_shapes_within_the_engine_range(tmp_path):
    from trtserve.cli import _confirm_grid
    from trtserve.errors import TrtServeError
    from trtserve.precision.measure import _grid_rows, grid_shapes

    shapes, seed = _confirm_grid("quick")
    assert grid_shapes("quick", shapes, seed, "all-MiniLM-L6-v2", 32, 512) == [
        ("quick", kind, b, s, 0) for kind in ("random", "real") for b in (1, 4) for s in (32, 64)]
    assert grid_shapes("quick", shapes, seed, "all-MiniLM-L6-v2", 2, 40) == [("quick", "random", 1, 32, 0),
                                                                            ("quick", "real", 1, 32, 0)]
    with pytest.raises(TrtServeError, match="no shape for SmolLM2-135M-Instruct"):
        grid_shapes("quick", shapes, seed, "SmolLM2-135M-Instruct", 32, 2048)
    grid = tmp_path / "one.toml"
    grid.write_text('models = ["m"]\nbackends = ["fp16-emulation"]\nprecisions = ["auto"]\nbatch = [8]\n'
                    'sequence = [64]\ninputs = ["random"]\nseed = 3\n')
    shapes, seed = _confirm_grid(str(grid))
    assert grid_shapes(str(grid), shapes, seed, "m", 32, 128) == [("one", "random", 8, 64, 3)]
    with pytest.raises(TrtServeError, match="--confirm-grid nope: no preset 'nope'"):
        _confirm_grid("nope")
    backend = SimpleNamespace(engine=SimpleNamespace(manifest=SimpleNamespace(
        model=SimpleNamespace(architecture=SimpleNamespace(vocab_size=49152)))))
    ids, mask = _grid_rows(backend.engine, "random", 8, 64, 0)
    expected = np.random.default_rng([0, 8, 64]).integers(1000, 49152, size=(8, 64))  # as `trtserve eval` feeds
    assert np.array_equal(ids, expected) and mask.all()


def test_a_grid_naming_a_model_by_path_confirms_under_the_id_the_build_gives_it(tmp_path):
    from trtserve.cli import _confirm_grid
    from trtserve.eval.grid import load_grid
    from trtserve.models.sources import model_id
    from trtserve.precision.measure import grid_shapes

    checkpoint = tmp_path / "models" / "my-model"
    checkpoint.mkdir(parents=True)
    gguf = tmp_path / "tiny.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert (model_id(str(checkpoint)), model_id(str(gguf)), model_id("SmolLM2-135M-Instruct")) == (
        "my-model", "tiny", "SmolLM2-135M-Instruct")
    grid = tmp_path / "by-path.toml"
    grid.write_text(f'models = ["{checkpoint}", "{gguf}"]\nbackends = ["onnxruntime"]\nprecisions = ["auto"]\n'
                    'batch = [2]\nsequence = [16]\ninputs = ["real"]\n')
    shapes, seed = _confirm_grid(str(grid))
    assert grid_shapes(str(grid), shapes, seed, "my-model", 4, 64) == [("by-path", "real", 2, 16, 0)]
    assert grid_shapes(str(grid), shapes, seed, "tiny", 4, 64) == [("by-path", "real", 2, 16, 0)]
    # what an evaluation engine's rebuild command carries: a file path it can read again, or a preset's name
    assert load_grid(path=grid).source == str(grid.absolute())
    assert load_grid(preset="quick").source == "quick"

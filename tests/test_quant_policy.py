"""The int8/int4 policies on a tiny torch decoder and the ONNX graph of the same weights, made here:
ONNX Runtime's quantizer read back exactly, each weight's sensitivity measured on the torch model, the
mix chosen by bisection, written as standard ONNX that the checker accepts, that ONNX Runtime fuses
into MatMulNBits and computes like torch with the same dequantized weights, and TensorRT-RTX parses."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trtserve.precision.measure import Target
from trtserve.precision.quant_policy import KEPT, apply_quantized, candidates
from trtserve.precision.sensitivity import choose, weight_key
from trtserve.precision.weight_quant import quantize_rows

VOCAB, HIDDEN, FFN = 48, 64, 96


class TinyDecoder(torch.nn.Module):
    """embedding -> up -> relu -> down (+ residual) -> LM head tied to the embedding."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.down = torch.nn.Linear(FFN, HIDDEN, bias=False)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for p in (self.embed.weight, self.up.weight, self.down.weight):
                p.copy_(torch.randn(p.shape, generator=g))
            self.down.weight[:, ::16] *= 40  # outlier inputs in each block: int4 hurts this weight most
        self.head.weight = self.embed.weight  # tied, as SmolLM2's

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        h = h + self.down(torch.relu(self.up(h))) / 50
        return SimpleNamespace(logits=self.head(h))


def graph_of(model: TinyDecoder) -> onnx.ModelProto:
    w = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    inits = {"embed": w["embed.weight"], "up": w["up.weight"].T.copy(), "down": w["down.weight"].T.copy(),
             "scale": np.array(1 / 50, np.float32)}
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h0"], name="embedding"),
             helper.make_node("MatMul", ["h0", "up"], ["u"], name="up_proj"),
             helper.make_node("Relu", ["u"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "down"], ["d"], name="down_proj"),
             helper.make_node("Mul", ["d", "scale"], ["ds"], name="scale"),
             helper.make_node("Add", ["h0", "ds"], ["h1"], name="residual"),
             helper.make_node("Transpose", ["embed"], ["embed_t"], name="tie", perm=[1, 0]),
             helper.make_node("MatMul", ["h1", "embed_t"], ["logits"], name="lm_head")]
    graph = helper.make_graph(nodes, "tiny",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "S"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", VOCAB])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))


def _rows(seed: int = 5, count: int = 4, length: int = 24) -> list[list[int]]:
    return np.random.default_rng(seed).integers(0, VOCAB, (count, length)).tolist()


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.ModelProto.FromString(model.SerializeToString())


def _run(model, ids, optimize: bool = True):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantizer_output_is_read_back_within_a_step(fmt):
    rows = np.random.default_rng(0).standard_normal((40, 96)).astype(np.float32)
    blocks = quantize_rows(rows, fmt, "w")
    error = np.abs(blocks.dequantized() - rows).reshape(40, 3, 32)
    assert np.all(blocks.scale > 0), "TensorRT takes positive scales only"
    assert np.all(error <= blocks.scale[..., None] * 0.5 * (1 + 1e-5))
    assert (blocks.minimum is None) == (fmt == "int8")
    assert blocks.q.dtype == (np.int8 if fmt == "int8" else np.uint8) and blocks.q.shape == rows.shape


def test_a_width_off_the_block_is_refused_by_name():
    with pytest.raises(ValueError, match="w_odd: input dimension 33 is not a multiple of the block size 32"):
        quantize_rows(np.zeros((4, 33), np.float32), "int4", "w_odd")


def test_loose_target_quantizes_everything_and_the_graph_computes_what_torch_does():
    torch_model = TinyDecoder().eval()
    fp32 = graph_of(torch_model)
    weights, eight_bit = candidates(fp32)
    assert len(weights) == 4 and len(eight_bit) == 2  # up, down, LM head, table; the head and table start at 8 bits
    choice = choose(torch_model, "decoder", weights, eight_bit, "int4", Target(min_top1=0.0, max_ppl_delta=1e9),
                    _rows())
    assert choice.kept == 0 and set(choice.sensitivity) == set(weights)
    model, report = apply_quantized(_copy(fp32), choice)
    onnx.checker.check_model(model, full_check=True)
    assert {k: v["format"] for k, v in report["gemms"].items()} == {"up_proj": "int4", "down_proj": "int4",
                                                                  "lm_head": "int8"}
    assert report["embeddings"]["embedding"]["format"] == "int8" and not report["fp32"]
    types = sorted(i.data_type for i in model.graph.initializer if i.data_type in (TensorProto.INT4, TensorProto.INT8))
    assert types == sorted([TensorProto.INT8, TensorProto.INT8, TensorProto.INT4, TensorProto.INT4])
    assert not {"embed", "up", "down"} & {i.name for i in model.graph.initializer}, "fp32 copies are gone"
    # torch with the same dequantized weights (head and table apart) computes what the graph does
    with torch.no_grad():
        deq = {name: torch.from_numpy(quantize_rows(w.detach().numpy(), fmt).dequantized())
               for name, w, fmt in (("embed", torch_model.embed.weight, "int8"), ("up", torch_model.up.weight, "int4"),
                                    ("down", torch_model.down.weight, "int4"),
                                    ("head", torch_model.head.weight, "int8"))}
        ref = TinyDecoder().eval()
        for name, value in deq.items():
            getattr(ref, name).weight = torch.nn.Parameter(value)
        ids = np.array(_rows(seed=9, count=2, length=7))
        want = ref(torch.from_numpy(ids)).logits.numpy()
    for optimize in (False, True):  # the plain DequantizeLinear graph, then ONNX Runtime's fused one
        np.testing.assert_allclose(_run(model, ids, optimize), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_strict_target_keeps_the_most_sensitive_weight_safer():
    torch_model = TinyDecoder().eval()
    fp32 = graph_of(torch_model)
    weights, eight_bit = candidates(fp32)
    down = weight_key("gemms", torch_model.down.weight.detach().numpy())
    loose = choose(torch_model, "decoder", weights, eight_bit, "int4", Target(min_top1=0.0, max_ppl_delta=1e9), _rows())
    assert max(loose.sensitivity, key=loose.sensitivity.get) == down  # the outlier weight
    strict = choose(torch_model, "decoder", weights, eight_bit, "int4", Target(min_top1=1.0, max_ppl_delta=0.0),
                    _rows())
    assert strict.kept >= 1 and strict.formats[down] == "int8"
    assert all(strict.formats[k] in ("int8", "fp32") for k in eight_bit)
    never = choose(torch_model, "decoder", weights, eight_bit, "int8", Target(min_top1=1.01), _rows())
    assert never.kept == len(never.sensitivity) and set(never.formats.values()) == {"fp32"}


def test_a_widened_choice_moves_the_next_most_sensitive_weights_one_step_and_says_so():
    """What the build does when its gate misses a shape the calibration text did not have."""
    from trtserve.precision.sensitivity import mixed, widened

    torch_model = TinyDecoder().eval()
    fp32 = graph_of(torch_model)
    weights, eight_bit = candidates(fp32)
    choice = choose(torch_model, "decoder", weights, eight_bit, "int4", Target(min_top1=0.0, max_ppl_delta=1e9),
                    _rows())
    low = dict(choice.formats)  # kept 0: every weight in its starting format
    ranked = sorted(choice.sensitivity, key=choice.sensitivity.get, reverse=True)
    for kept in (1, 2, 4):
        wider = widened(choice, kept)
        assert wider.formats == mixed(low, choice.sensitivity, kept)  # what the calibration search would write
        assert wider.kept == kept and wider.kept_by_calibration == 0 and wider.whole == choice.whole
        assert all(wider.formats[k] == {"int4": "int8", "int8": "fp32"}[low[k]] for k in ranked[:kept])
        assert all(wider.formats[k] == low[k] for k in ranked[kept:])
    twice = widened(widened(choice, 1), 3)  # widening again starts after the weights already moved
    assert twice.formats == widened(choice, 3).formats and twice.kept_by_calibration == 0
    _, report = apply_quantized(_copy(fp32), widened(choice, 1))
    assert report["kept_safer"] == 1 and report["kept_safer_by_calibration"] == 0
    assert "kept_safer_by_calibration" not in apply_quantized(_copy(fp32), choice)[1]
    from trtserve.engine_builder.info import _graph

    assert "widened because the gate missed with the 0 chosen on calibration text, where that mix" in _graph(report)
    from trtserve.precision.write import widening_counts as _widening

    tries = _widening(choice, "int4")  # what a plan whose full gate misses tries, in order
    assert tries[0] == 0 and tries == sorted(tries) and 4 not in tries  # all 4 safer: no int4 weight left
    assert all("int4" in widened(choice, kept).formats.values() for kept in tries)
    assert len(tries) > 1  # every weight of this model is off the int4 grid: each measured above 0
    on_grid = dataclasses.replace(choice, sensitivity=dict.fromkeys(choice.sensitivity, 0.0))
    assert _widening(on_grid, "int4") == [0]  # weights on their format's grid: moving them gains nothing


def test_eight_bit_gemms_outside_the_activation_plan_keep_fp32_weights():
    torch_model = TinyDecoder().eval()
    fp32 = graph_of(torch_model)
    weights, eight_bit = candidates(fp32)
    choice = choose(torch_model, "decoder", weights, eight_bit, "int4", Target(min_top1=0.0, max_ppl_delta=1e9),
                    _rows())
    _, report = apply_quantized(_copy(fp32), choice, int8_activations=frozenset({"up_proj"}))
    assert report["fp32"]["lm_head"]["reason"] == KEPT
    assert report["gemms"]["down_proj"]["format"] == "int4"  # 4-bit weights are fast on fp32 activations too


def test_tensorrt_rtx_parses_the_quantized_graph():
    trt = pytest.importorskip("tensorrt_rtx", reason="pip install tensorrt-rtx-cu13 (parses ONNX without a GPU)")
    torch_model = TinyDecoder().eval()
    fp32 = graph_of(torch_model)
    weights, eight_bit = candidates(fp32)
    choice = choose(torch_model, "decoder", weights, eight_bit, "int4", Target(min_top1=0.0, max_ppl_delta=1e9),
                    _rows())
    model, _ = apply_quantized(_copy(fp32), choice)
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(model.SerializeToString()), [parser.get_error(i).desc() for i in range(parser.num_errors)]
    kinds = [network.get_layer(i).type for i in range(network.num_layers)]
    assert kinds.count(trt.LayerType.DEQUANTIZE) >= 3 and trt.LayerType.MATRIX_MULTIPLY in kinds


def test_the_measured_mix_is_cached_by_content(tmp_path):
    torch_model = TinyDecoder().eval()
    weights, eight_bit = candidates(graph_of(torch_model))
    target = Target(min_top1=0.9, max_ppl_delta=0.2)
    first = choose(torch_model, "decoder", weights, eight_bit, "int4", target, _rows(), cache_dir=tmp_path)
    again = choose(None, "decoder", weights, eight_bit, "int4", target, _rows(), cache_dir=tmp_path)  # no model: cached
    assert again == first and len(list(tmp_path.iterdir())) == 1
    other = choose(torch_model, "decoder", weights, eight_bit, "int4", target, _rows(seed=6), cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2 and set(other.formats) == set(first.formats)


def test_sensitivity_is_measured_in_one_forward_pass_and_leaves_every_weight_as_it_was():
    """Every weight's sensitivity comes from one calibration pass (each module computing its output again with
    its weight quantized), whatever the number of weights; the mix tries put each weight back."""
    from trtserve.precision.sensitivity import _Reference, mixed

    torch_model = TinyDecoder().eval()
    weights, eight_bit = candidates(graph_of(torch_model))
    before = {name: p.detach().clone() for name, p in torch_model.named_parameters()}
    calls = []
    torch_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    ref = _Reference(torch_model, "decoder", _rows())
    low = {key: "int8" if key in eight_bit else "int4" for key in weights}
    calls.clear()
    ranking = ref.ranking(low)
    assert len(calls) == 1 and set(ranking) == set(weights) and all(v > 0 for v in ranking.values())
    # the relative error of each module's output: the outlier-laden down projection quantizes worst
    assert max(ranking, key=ranking.get) == weight_key("gemms", torch_model.down.weight.detach().numpy())
    whole = ref.metrics(mixed(low, ranking, 0))
    assert 0 < whole["effect"] and whole["top1"] < 1
    assert ref.metrics(dict.fromkeys(weights, "fp32"))["effect"] == 0  # nothing quantized: the fp32 outputs
    after = dict(torch_model.named_parameters())
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)
    assert torch_model.head.weight is torch_model.embed.weight  # still tied


def test_a_graph_without_its_weights_is_quantized_from_its_file_as_the_graph_in_memory_is(tmp_path):
    """The build's path: the export loaded as structure only, each weight read from the data file as the writer
    reaches it, the rest copied from that file when the graph is saved."""
    from trtserve.graph_files import load_graph, save_graph

    torch_model = TinyDecoder().eval()
    fp32 = graph_of(torch_model)
    save_graph(fp32, tmp_path / "fp32.onnx")
    structure = load_graph(tmp_path / "fp32.onnx", weights=False)
    assert not any(i.raw_data for i in structure.graph.initializer if i.name in ("embed", "up", "down"))
    weights, eight_bit = candidates(structure, tmp_path)
    assert (weights, eight_bit) == candidates(fp32)
    assert set(weights.values()) == {(VOCAB, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)}
    choice = choose(torch_model, "decoder", weights, eight_bit, "int4", Target(min_top1=0.0, max_ppl_delta=1e9),
                    _rows())
    in_memory, report = apply_quantized(_copy(fp32), choice)
    streamed, streamed_report = apply_quantized(structure, choice, base=tmp_path)
    assert streamed_report == report
    save_graph(streamed, tmp_path / "int4.onnx", base=tmp_path)
    ids = np.array(_rows(seed=3, count=2, length=5))
    np.testing.assert_array_equal(_run(load_graph(tmp_path / "int4.onnx"), ids), _run(in_memory, ids))

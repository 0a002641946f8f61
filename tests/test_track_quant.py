"""int8 and int4 for parallel-track engines: projections as plain matrices in each track's graph, the
sensitivity choice measured on the torch reference's stacked weights, and the engines gated against it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from tests.conftest import run_cli
from trtserve.models.parallel_track import PTConfig
from trtserve.models.pt_model import ParallelTrackModel, linear

CONFIG = dict(vocab_size=300, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=128,
              num_layers=4, n_tracks=4, block_depth=2)


def test_a_shard_given_as_a_matrix_computes_what_the_stack_does():
    torch.manual_seed(0)
    x, stack = torch.randn(1, 2, 5, 64), torch.randn(1, 48, 64)
    torch.testing.assert_close(linear(x, stack[0]), linear(x, stack), rtol=1e-5, atol=1e-5)


def test_the_reference_swaps_one_track_slice_and_restores_every_weight():
    from trtserve.precision.sensitivity import weight_key
    from trtserve.precision.track_quant import TrackReference

    torch.manual_seed(0)
    model = ParallelTrackModel(PTConfig(**CONFIG)).eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rows = np.random.default_rng(0).integers(1, 300, (4, 128)).tolist()
    reference = TrackReference(model, rows)
    # every track's projection of every layer is a weight of its own, the table (and tied head) one more
    assert len(reference.originals) == CONFIG["num_layers"] * 7 * CONFIG["n_tracks"] + 1
    key = weight_key("gemms", model.layers[1].down_proj[2].detach().numpy())
    assert reference.originals[key][0] == "layers.1.down_proj[track 2]"
    unchanged = reference.metrics({})
    assert unchanged["top1"] == 1.0 and unchanged["effect"] == 0.0
    quantized = reference.metrics({key: "int4"})
    assert quantized["effect"] > 0  # the slice was swapped in ...
    for name, p in model.named_parameters():  # ... and every weight is back, bit for bit
        assert torch.equal(p, before[name]), name


@pytest.fixture(scope="module")
def tiny_pt():
    from trtserve.research.pt_train import checkpoint

    return checkpoint("tiny", "pt")


def test_the_track_rebuild_command_carries_the_target_given_and_nothing_it_was_not_given():
    from trtserve.engine_builder.sharding import _build_command
    from trtserve.precision.measure import Target

    target = Target.parse("top1=0.98,ppl_delta=0.02")
    parts = _build_command("/c/pt", "/e", "int4", target, True).split()
    assert parts[:7] == ["trtserve", "build-engine", "/c/pt", "--out", "/e", "--precision", "int4"]
    assert Target.parse(parts[parts.index("--fidelity-target") + 1]) == target and parts[-1] == "--allow-low-fidelity"
    assert _build_command("/c/pt", "/e", "fp32", None, False) == "trtserve build-engine /c/pt --out /e --precision fp32"


@pytest.mark.models
@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_quantized_track_engines_pass_their_gate_and_shard_like_one_process(tiny_pt, precision, tmp_path):
    from tests.test_parallel_track import sharded_steps
    from trtserve.engine_dir import open_engine_dir
    from trtserve.runtime.track_engines import TrackEngines

    out = tmp_path / precision
    result = run_cli("build-engine", str(tiny_pt), "--out", str(out), "--precision", precision)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"fidelity vs torch fp32 ({precision}): passed" in result.stdout, result.stdout
    manifest = open_engine_dir(out).manifest
    formats = manifest.precision.formats
    assert formats.get(precision, 0) > 0 and manifest.fidelity.passed, formats
    lengths = manifest.fidelity.lengths
    assert max(lengths) == manifest.model.architecture.max_positions, lengths
    # the written formats are what ONNX Runtime runs: one MatMulNBits per quantized product (query, key and
    # value fused into one, gate and up into one), the table gathered from its blocks
    for name, graph in manifest.precision.graph.items():
        ops = Counter(n.op_type for n in onnx.load(str(out / name.replace(".onnx", ".ort.onnx"))).graph.node)
        products = {tuple(e.get("computed_with", [n])) for n, e in graph["gemms"].items()}
        assert ops["MatMulNBits"] == len(products), (name, ops)
        assert ops["GatherBlockQuantized"] == len(graph["embeddings"]), (name, ops)
    info = run_cli("info", str(out))
    assert f"precision   {precision}: weights" in info.stdout and "fidelity    passed" in info.stdout, info.stdout
    # two workers of one track pair each give what all tracks in one process give, prefill and 8 steps
    prompt = np.random.default_rng(3).integers(1, 4097, (2, 12))
    engines = TrackEngines(out, manifest, tracks=range(4), threads=1)
    expected, tokens = [engines.forward(prompt, reduce=lambda x: x)], []
    for _ in range(8):
        tokens.append(expected[-1].argmax(-1)[:, None])
        expected.append(engines.forward(tokens[-1], reduce=lambda x: x, new=False))
    steps = sharded_steps(out, "pt", 2, prompt, tokens)
    assert max(np.abs(s.logits - e).max() for s, e in zip(steps, expected)) <= 1e-4


@pytest.mark.models
def test_a_target_the_engines_cannot_meet_is_refused_and_nothing_is_written(tiny_pt, tmp_path):
    out = tmp_path / "refused"
    result = run_cli("build-engine", str(tiny_pt), "--out", str(out), "--precision", "int4",
                     "--fidelity-target", "top1=1.0,ppl_delta=0,token_cosine=1.0,cosine=1.0")
    assert result.returncode != 0 and "miss the fidelity target" in result.stderr, result.stderr[-2000:]
    assert "--allow-low-fidelity" in result.stderr and not out.exists()  # no directory left behind

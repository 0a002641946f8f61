"""Cross-encoders through the real server: a tiny random BertForSequenceClassification (one label, MiniLM's
tokenizer, token types for the pair) built through the CLI, scored on /v1/rerank and /rerank (Cohere/Jina as
vLLM serves them, and TEI's body) and /v1/score against transformers on the same pairs; bad bodies are 4xx
naming the field."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest

from tests.conftest import run_cli
from trtserve.testing.server import start_server, stop_server

pytestmark = pytest.mark.models

QUERY = "where do cats sleep"
DOCUMENTS = ["Cats sleep on the sofa most of the afternoon.", "Paris is the capital of France.",
             "A cat", "The stock market fell sharply on Monday after the announcement of new tariffs on steel."]


@pytest.fixture(scope="module")
def cross_encoder(minilm_dir, tmp_path_factory):
    torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    import transformers

    root = tmp_path_factory.mktemp("cross-encoder")
    folder = root / "checkpoint"
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=128, num_labels=1)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    with torch.no_grad():  # a head wide enough that the scores spread over the sigmoid
        model.classifier.weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, folder / name)
    result = run_cli("build-engine", str(folder), "--out", str(root / "engine"), "--max-seq", "64", "--max-batch", "8")
    assert result.returncode == 0, result.stderr[-3000:]
    proc, url = start_server(root / "engine")
    yield folder, root / "engine", url, httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    stop_server(proc)


def _logits(folder, first: list[str], second: list[str]) -> np.ndarray:
    import torch

    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve

    model, tokenizer = load_torch_model(resolve(str(folder)), attention="eager"), load_hf_tokenizer(folder)
    out = []
    for a, b in zip(first, second):  # each pair alone: no padding on the reference side
        with torch.inference_mode():
            out.append(float(model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0]))
    return np.array(out)


def test_the_engine_is_a_cross_encoder_and_says_so(cross_encoder):
    _, engine, url, name = cross_encoder
    assert "scores      cross-encoder, one logit, scored as its sigmoid" in run_cli("info", str(engine)).stdout
    refused = httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": "x"}, timeout=30)
    assert refused.status_code == 400 and "/v1/rerank" in refused.json()["error"]["message"]


def test_rerank_orders_documents_by_transformers_scores(cross_encoder):
    folder, _, url, name = cross_encoder
    want = 1 / (1 + np.exp(-_logits(folder, [QUERY] * len(DOCUMENTS), DOCUMENTS)))
    body = {"model": name, "query": QUERY, "documents": DOCUMENTS}
    response = httpx.post(f"{url}/v1/rerank", json=body, timeout=60)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-want))
    np.testing.assert_allclose([r["relevance_score"] for r in results], np.sort(want)[::-1], atol=1e-5)
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]] for r in results]
    assert response.json()["usage"]["total_tokens"] > 0 and response.json()["model"] == name
    top = httpx.post(f"{url}/rerank", json={**body, "top_n": 2, "return_documents": False,
                                            "documents": [{"text": d} for d in DOCUMENTS]}, timeout=60).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
    assert all("document" not in r for r in top["results"])
    raw = httpx.post(f"{url}/v1/rerank", json={**body, "raw_scores": True}, timeout=60).json()["results"]
    np.testing.assert_allclose([r["relevance_score"] for r in raw], np.sort(np.log(want / (1 - want)))[::-1], atol=1e-4)


def test_teis_rerank_body_gets_teis_answer_with_raw_scores(cross_encoder):
    folder, _, url, _ = cross_encoder
    logits = _logits(folder, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    response = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCUMENTS, "raw_scores": True,
                                                 "return_text": True}, timeout=60)
    assert response.status_code == 200, response.text
    ranks = response.json()
    assert [r["index"] for r in ranks] == list(np.argsort(-logits))
    np.testing.assert_allclose([r["score"] for r in ranks], np.sort(logits)[::-1], atol=1e-5)
    assert ranks[0]["text"] == DOCUMENTS[ranks[0]["index"]]


def test_score_pairs_one_to_many_and_many_to_many(cross_encoder):
    folder, _, url, name = cross_encoder
    one = httpx.post(f"{url}/v1/score", json={"model": name, "text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
    want = 1 / (1 + np.exp(-_logits(folder, [QUERY] * len(DOCUMENTS), DOCUMENTS)))
    np.testing.assert_allclose([d["score"] for d in one["data"]], want, atol=1e-5)
    firsts = ["cats", "France", "a cat", "money"]
    many = httpx.post(f"{url}/v1/score", json={"model": name, "text_1": firsts, "text_2": DOCUMENTS}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in many["data"]],
                               1 / (1 + np.exp(-_logits(folder, firsts, DOCUMENTS))), atol=1e-5)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["fine", ""]}, "documents"),
    ("/v1/rerank", {"query": 123, "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -3}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 10_000}, "documents"),
    ("/rerank", {"query": QUERY, "documents": ["a"], "texts": ["b"]}, "documents"),
    ("/rerank", {"query": QUERY}, "documents"),
    ("/rerank", {"query": QUERY, "documents": ["a"], "return_text": True}, "return_text"),
    ("/rerank", {"query": QUERY, "texts": ["a"], "return_documents": False}, "return_documents"),
    ("/rerank", {"query": QUERY, "texts": [" ".join(["word"] * 100)]}, "texts"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/rerank", {"query": " ".join(["word"] * 80), "texts": ["a"], "truncate": True}, "query"),
])
def test_bad_bodies_are_400s_naming_the_field(cross_encoder, path, body, field):
    url = cross_encoder[2]
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in (error.get("param") or "") + error["message"], error


def test_a_long_document_is_cut_where_truncate_asks(cross_encoder):
    url = cross_encoder[2]
    long_text = " ".join(["word"] * 100)
    response = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": [long_text, "cats"], "truncate": True},
                          timeout=60)
    assert response.status_code == 200 and len(response.json()) == 2

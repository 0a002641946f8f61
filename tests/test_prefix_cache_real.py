"""Automatic prefix caching through the real server: chat turns that share a long system prompt give
the same greedy answers with the cache as without it, and /metrics counts the reused tokens."""

import httpx
import pytest

from trtserve.testing.server import metric, start_server, stop_server

pytestmark = pytest.mark.models
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are a careful geography tutor. " * 40).strip()  # a shared prefix of a few hundred tokens
QUESTIONS = ["What is the capital of France?", "What is the capital of Italy?", "What is the capital of France?"]


def answers(url: str) -> list[str]:
    out = []
    for question in QUESTIONS:
        response = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["message"]["content"])
    return out


def test_cached_prefixes_give_the_same_answers_and_are_counted(engines):
    uncached, url = start_server(engines["smollm2"], "--prefix-cache-mib", "0")
    try:
        want = answers(url)
        assert metric(url, "trtserve_prefix_cache_queries_total") == 0  # off: nothing looked up
    finally:
        stop_server(uncached)
    cached, url = start_server(engines["smollm2"])
    try:
        assert answers(url) == want
        prompt = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]}).json()["count"]
        queries = metric(url, "trtserve_prefix_cache_queries_total")
        hits = metric(url, "trtserve_prefix_cache_hits_total")
        assert queries >= 3 * prompt - 20  # every prompt was looked up
        # the second turn reuses the system prompt's blocks (280 tokens: at least 256 in full blocks of 16),
        # the third (the first again) every full block but the one holding its last token
        assert hits >= 256 + (prompt - 1) // 16 * 16, (queries, hits, prompt)
    finally:
        stop_server(cached)

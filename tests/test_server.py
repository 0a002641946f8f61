"""The real server on a free port, driven by the official openai client and plain HTTP."""

import base64
import concurrent.futures
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import require_package
from trtserve.testing.server import metric, start_server, stop_server

pytestmark = pytest.mark.models
KEY = "test-key"


@pytest.fixture(scope="module")
def server(minilm_engine):
    proc, url = start_server(minilm_engine, "--api-key", KEY)
    yield url
    stop_server(proc)


@pytest.fixture()
def client(server):
    require_package("openai", "pip install openai")
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def test_embeddings_match_the_engine_run_in_process(client, minilm_engine):
    from trtserve.runtime import load_backend
    from trtserve.runtime.text import TextEngine

    texts = ["The capital of France is Paris.", "Anarchism is a political philosophy."]
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    served = np.array([d.embedding for d in response.data])
    local = TextEngine(load_backend(minilm_engine)).embed(texts)
    assert served.shape == (2, 384) and np.max(np.abs(served - local)) < 1e-5
    assert response.usage.prompt_tokens == response.usage.total_tokens > 10
    single = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[0])
    assert np.max(np.abs(np.array(single.data[0].embedding) - local[0])) < 1e-5


def test_base64_encoding_and_token_arrays(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    as_float = httpx.post(f"{server}/v1/embeddings", headers=headers,
                          json={"model": "all-MiniLM-L6-v2", "input": [[101, 7592, 2088, 102]]}).json()
    as_b64 = httpx.post(f"{server}/v1/embeddings", headers=headers, json={
        "model": "all-MiniLM-L6-v2", "input": [[101, 7592, 2088, 102]], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, as_float["data"][0]["embedding"], atol=1e-7)
    assert as_float["usage"]["prompt_tokens"] == 4


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == ["all-MiniLM-L6-v2"]


def test_openai_errors(client, server):
    import openai

    with pytest.raises(openai.BadRequestError, match="`input` is empty"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=[])
    with pytest.raises(openai.BadRequestError, match="empty string"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=["fine", ""])
    with pytest.raises(openai.BadRequestError, match="limit is 512 tokens"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 600)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="gpt-4", input="hi")
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


@pytest.mark.parametrize(
    ("kwargs", "status", "message"),
    [
        ({"content": b"{bad json", "headers": {"content-type": "application/json"}}, 400, "not valid JSON"),
        ({"content": b"model=x", "headers": {"content-type": "text/plain"}}, 400, ""),
        ({"json": {"model": "all-MiniLM-L6-v2", "input": [1.5]}}, 400, "input"),
        ({"json": {"model": "all-MiniLM-L6-v2", "input": "x" * (3 << 20)}}, 413, "the limit is"),
        ({"content": b'{"model": "all-MiniLM-L6-v2", "input": ["ok", "a\\ud800"]}',
          "headers": {"content-type": "application/json"}}, 400, "input.1: Value error, is not valid Unicode"),
        ({"content": b'{"model": "all-MiniLM-L6-v2", "input": "\xff\xfe"}',
          "headers": {"content-type": "application/json"}}, 400, ""),
        ({"content": b'{"model": "all-MiniLM-L6-v2", "input": "hi", "dimensions": Infinity}',
          "headers": {"content-type": "application/json"}}, 400, "dimensions"),
    ],
)
def test_malformed_requests_get_openai_shaped_errors(server, kwargs, status, message):
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    response = httpx.post(f"{server}/v1/embeddings", headers=headers, timeout=30, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"]
    assert httpx.get(f"{server}/health").status_code == 200  # still serving


def test_health_and_metrics_need_no_key(server, client):
    client.embeddings.create(model="all-MiniLM-L6-v2", input="count me")
    anonymous = httpx.get(f"{server}/health").json()
    assert anonymous["status"] == "ok" and "workers" not in anonymous  # pids only for the key holder
    keyed = httpx.get(f"{server}/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert keyed["workers"][0]["pid"] > 0
    text = httpx.get(f"{server}/metrics").text
    assert 'trtserve_requests_total{route="/v1/embeddings",status="200"}' in text
    assert "trtserve_batch_size_bucket" in text and "trtserve_queue_seconds_count" in text


def test_concurrent_requests_are_batched_and_a_full_queue_answers_429(minilm_engine):
    proc, url = start_server(minilm_engine, "--max-queue", "4", "--max-wait-ms", "50")
    try:
        body = {"model": "all-MiniLM-L6-v2", "input": "Anarchism is a political philosophy. " * 40}
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            responses = list(pool.map(lambda _: httpx.post(f"{url}/v1/embeddings", json=body, timeout=60), range(32)))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
        limited = next(r for r in responses if r.status_code == 429)
        assert limited.headers["retry-after"] == "1" and "queue is full" in limited.json()["error"]["message"]
        # at least one batch held more than one row
        assert metric(url, "trtserve_batch_size_sum") > metric(url, "trtserve_batch_size_count")
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        stop_server(proc)
    assert proc.returncode == 0  # SIGTERM shuts the server down cleanly


def test_schemathesis_finds_no_server_error(server):
    """Property-based requests generated from the server's own OpenAPI schema: never a 5xx."""
    require_package("schemathesis", "pip install schemathesis")
    st = Path(sys.executable).with_name("st")
    result = subprocess.run(
        [str(st), "run", f"{server}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "30",
         "--seed", "1", "-H", f"Authorization: Bearer {KEY}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout.split("Test cases:")[-1]


def test_request_timeout_is_504(minilm_engine):
    proc, url = start_server(minilm_engine, "--request-timeout", "0.001")
    try:
        body = {"model": "all-MiniLM-L6-v2", "input": ["Anarchism is a political philosophy. " * 60] * 8}
        response = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
        assert response.status_code == 504
        assert "longer than 0.001 s" in response.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 200  # the server keeps serving
    finally:
        stop_server(proc)

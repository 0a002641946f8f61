"""Worker processes behind the real server: a killed worker is restarted and its requests get 503,
a client that goes away has its queued rows dropped, SIGTERM drains, body and input limits."""

import collections
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from trtserve.testing.server import metric, start_server, stop_server

pytestmark = pytest.mark.models
MODEL = "all-MiniLM-L6-v2"
SENTENCE = "Anarchism is a political philosophy and movement that is sceptical of authority."


def embed(url, inputs, timeout=60):
    return httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": inputs}, timeout=timeout)


def wait_healthy(url, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        response = httpx.get(f"{url}/health", timeout=5)
        if response.status_code == 200:
            return response.json()
        time.sleep(0.2)
    raise AssertionError(f"not healthy again within {seconds} s: {response.text}")


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def two_workers(minilm_engine):
    proc, url = start_server(minilm_engine, "--workers", "2", "--max-batch", "4")
    yield url
    stop_server(proc)


def test_two_workers_share_the_load_and_agree(two_workers):
    workers = httpx.get(f"{two_workers}/health").json()["workers"]
    assert len(workers) == 2 and all(w["ready"] for w in workers)
    assert len({w["pid"] for w in workers}) == 2 and os.getpid() not in {w["pid"] for w in workers}
    texts = [f"{SENTENCE} ({i})" for i in range(16)]
    results = []
    threads = [threading.Thread(target=lambda: results.append(embed(two_workers, texts).json())) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    vectors = [np.array([d["embedding"] for d in r["data"]]) for r in results]
    assert all(np.max(np.abs(v - vectors[0])) < 1e-5 for v in vectors)  # same answer whichever worker ran it


def test_killed_worker_is_restarted_and_its_requests_get_503(two_workers):
    before = httpx.get(f"{two_workers}/health").json()["workers"]
    victim = before[0]["pid"]
    codes, messages, stop = collections.Counter(), set(), time.time() + 6

    def load():
        with httpx.Client(timeout=60) as client:
            while time.time() < stop:
                response = client.post(f"{two_workers}/v1/embeddings", json={"model": MODEL, "input": [SENTENCE] * 8})
                codes[response.status_code] += 1
                if response.status_code != 200:
                    messages.add(response.json()["error"]["message"])

    threads = [threading.Thread(target=load) for _ in range(8)]
    [t.start() for t in threads]
    time.sleep(1.5)
    os.kill(victim, signal.SIGKILL)
    [t.join(timeout=90) for t in threads]
    assert not any(t.is_alive() for t in threads), "a request hung after its worker died"
    assert set(codes) <= {200, 503} and codes[200] > 0, codes
    assert all("stopped while running" in m or "restarting" in m for m in messages), messages
    after = wait_healthy(two_workers)["workers"]
    assert after[0]["pid"] != victim and after[0]["restarts"] == 1 and after[1]["pid"] == before[1]["pid"]
    assert embed(two_workers, SENTENCE).status_code == 200
    assert metric(two_workers, "trtserve_worker_restarts_total") == 1
    assert metric(two_workers, "trtserve_workers_ready") == 2


def test_client_that_disconnects_has_its_queued_rows_dropped(two_workers):
    dropped = metric(two_workers, "trtserve_dropped_rows_total")
    with pytest.raises(httpx.TimeoutException):
        embed(two_workers, [f"{SENTENCE} ({i})" for i in range(200)], timeout=0.3)
    deadline = time.time() + 30
    while metric(two_workers, "trtserve_client_disconnects_total") < 1 and time.time() < deadline:
        time.sleep(0.1)
    assert metric(two_workers, "trtserve_client_disconnects_total") >= 1
    while metric(two_workers, "trtserve_dropped_rows_total") == dropped and time.time() < deadline:
        time.sleep(0.1)
    assert metric(two_workers, "trtserve_dropped_rows_total") > dropped
    assert embed(two_workers, SENTENCE).status_code == 200


def test_bodies_over_the_limit_get_413_with_or_without_content_length(two_workers):
    body = b'{"model": "%s", "input": "%s"}' % (MODEL.encode(), b"x" * (10 << 20))
    headers = {"content-type": "application/json"}
    sized = httpx.post(f"{two_workers}/v1/embeddings", content=body, headers=headers, timeout=60)
    streamed = httpx.post(f"{two_workers}/v1/embeddings", content=iter([body[i:i + 65536]
                          for i in range(0, len(body), 65536)]), headers=headers, timeout=60)
    for response in (sized, streamed):
        assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
    assert "content-length" not in streamed.request.headers
    assert embed(two_workers, SENTENCE).status_code == 200


def test_more_inputs_than_the_queue_holds_is_400_not_429(minilm_engine):
    proc, url = start_server(minilm_engine, "--max-queue", "8", "--workers", "0")
    try:
        response = embed(url, [SENTENCE] * 9)
        assert response.status_code == 400 and "queues at most 8" in response.json()["error"]["message"]
        assert embed(url, [SENTENCE] * 8).status_code == 200  # in-process backend (--workers 0) serves too
        assert httpx.get(f"{url}/health").json()["workers"][0]["pid"] == proc.pid
    finally:
        stop_server(proc)


def test_sigterm_finishes_in_flight_requests_then_exits_0(minilm_engine):
    proc, url = start_server(minilm_engine, "--max-batch", "2")
    worker = httpx.get(f"{url}/health").json()["workers"][0]["pid"]
    result = {}
    def request():
        result["r"] = embed(url, [f"{SENTENCE} {i}" for i in range(200)])
        result["done"] = time.time()

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(0.3)  # the request is being served, 2 rows at a time
    proc.send_signal(signal.SIGTERM)
    signalled = time.time()
    thread.join(timeout=60)
    assert proc.wait(timeout=60) == 0
    assert result["r"].status_code == 200 and len(result["r"].json()["data"]) == 200
    assert result["done"] > signalled  # it was still in flight when the signal came
    assert not running(worker)  # the worker process is gone too
    stop_server(proc)


def test_operator_flags_https_cors_root_path_log_level_and_the_healthcheck_that_follows_them(minilm_engine,
                                                                                              tmp_path):
    """--ssl-keyfile/--ssl-certfile serve HTTPS (verified against the issuing CA), --allowed-origins answers a
    browser's preflight before the API key check, --root-path reaches the OpenAPI page, --log-level and
    --disable-uvicorn-access-log shape the log, and `trtserve healthcheck` finds the server from the same
    TRTSERVE_* variables."""
    trustme = pytest.importorskip("trustme", reason="needs trustme: pip install -e .[test]")
    from tests.conftest import run_cli

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key, chain, authority = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key))
    cert.cert_chain_pems[0].write_to_path(str(chain))
    ca.cert_pem.write_to_path(str(authority))
    refused = run_cli("serve", str(minilm_engine), "--ssl-keyfile", str(key), timeout=120)
    assert refused.returncode == 2 and "--ssl-keyfile needs --ssl-certfile too" in refused.stderr, refused.stderr
    proc, url = start_server(minilm_engine, "--ssl-keyfile", str(key), "--ssl-certfile", str(chain), "--api-key",
                             "k", "--allowed-origins", "https://app.example", "--root-path", "/api",
                             "--log-level", "warning", "--disable-uvicorn-access-log", verify=authority)
    try:
        import ssl

        client = httpx.Client(verify=ssl.create_default_context(cafile=str(authority)), timeout=60)
        preflight = client.options(f"{url}/v1/embeddings", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200 and \
            preflight.headers["access-control-allow-origin"] == "https://app.example"
        other = client.options(f"{url}/v1/embeddings", headers={"Origin": "https://evil.example",
                                                                "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
        answer = client.post(f"{url}/v1/embeddings", json={"input": SENTENCE},  # `model` left out: the only one
                             headers={"Authorization": "Bearer k", "Origin": "https://app.example"})
        assert answer.status_code == 200 and answer.json()["model"] == MODEL
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        described = client.get(f"{url}/openapi.json", headers={"Authorization": "Bearer k"})
        assert described.json()["servers"] == [{"url": "/api"}]  # a proxy's prefix, in links the page gives
        port = url.rsplit(":", 1)[1]
        healthy = run_cli("healthcheck", env={"TRTSERVE_PORT": port, "TRTSERVE_SSL_CERTFILE": str(chain)}, timeout=60)
        assert healthy.returncode == 0 and f"https://127.0.0.1:{port}/health answered 200" in healthy.stdout
        log = proc.log_path.read_text()
        assert "POST /v1/embeddings" not in log and " INFO " not in log, log[-2000:]
    finally:
        stop_server(proc)

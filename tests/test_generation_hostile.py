"""Generation serving under hostile input, overload and faults, with the real SmolLM2 engine and the
real server on loopback. After every hostile body the server must still be healthy, answer a canary
request, and have restarted no worker; overload is a 429; faults are answered within the deadline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, require_package
from trtserve.testing.server import start_server, stop_server

pytestmark = pytest.mark.models
MODEL = "SmolLM2-135M-Instruct"
CANARY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def smollm2(engines):
    return engines["smollm2"]


@pytest.fixture(scope="module")
def server(smollm2):
    proc, url = start_server(smollm2, "--max-num-seqs", "8", "--max-n", "4", "--max-queue", "64",
                             "--max-queue-tokens", "8192")
    yield url
    stop_server(proc)


def workers(url: str) -> list[tuple[int, int]]:
    return [(w["pid"], w["restarts"]) for w in httpx.get(f"{url}/health", timeout=10).json()["workers"]]


def raw(path: str, body: bytes, url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", content=body, headers={"content-type": "application/json"}, timeout=60)


HOSTILE = [  # (route, raw JSON body, expected status)
    ("completions", {"prompt": "Hi", "seed": -1, "temperature": 1}, 200),
    ("completions", {"prompt": "Hi", "seed": 2**63 - 1, "temperature": 1, "n": 2}, 200),
    ("completions", {"prompt": "Hi", "seed": 2**64}, 400),
    ("completions", {"prompt": "Hi", "temperature": 1e-30, "max_tokens": 3}, 200),
    ("completions", {"prompt": "Hi", "temperature": 5e-324, "top_p": 1e-300, "max_tokens": 3}, 200),
    ("completions", {"prompt": "Hi", "top_k": 10**18, "max_tokens": 3}, 200),
    ("completions", {"prompt": "Hi", "top_k": 10**30}, 400),
    ("completions", {"prompt": "Hi", "max_tokens": 10**40}, 400),
    ("completions", {"prompt": "Hi", "max_tokens": -(10**40)}, 400),
    ("completions", {"prompt": "Hi", "logprobs": 20, "max_tokens": 2, "presence_penalty": 2,
                     "frequency_penalty": -2}, 200),
    ("completions", {"prompt": ["Hi"] * 20000}, 400),  # prompts x n over --max-queue
    ("completions", {"prompt": ["Hi"] * 17, "n": 4}, 400),
    ("completions", {"prompt": [[1] * 2000] * 8}, 400),  # prompt tokens over --max-queue-tokens
    ("completions", {"prompt": [[]]}, 400),
    ("completions", {"prompt": [[49152]]}, 400),
    ("completions", {"prompt": [[-1]]}, 400),
    ("completions", {"prompt": [1.5]}, 400),
    ("completions", {"prompt": [["a"]]}, 400),
    ("completions", {"prompt": None}, 400),
    ("completions", {"prompt": {"text": "Hi"}}, 400),
    ("completions", {"prompt": "Hi", "stop": "x" * 100000}, 400),
    ("completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("completions", {"prompt": "Hi", "stop": [""]}, 400),
    ("completions", {"prompt": "Hi", "stop": [["nested"]]}, 400),
    ("completions", {"prompt": "{{ 7*7 }} {% for x in range(10**9) %}{% endfor %}", "max_tokens": 2}, 200),
    ("completions", {"prompt": "Hi", "stream": "sometimes"}, 400),
    ("completions", {"prompt": "Hi", "stream_options": {"include_usage": "maybe"}}, 400),
    ("completions", {"prompt": "Hi", "n": 0}, 400),
    ("completions", {"prompt": "Hi", "n": 10**6}, 400),
    ("completions", {"prompt": "Hi", "echo": True, "logprobs": 3, "max_tokens": 2, "stream": True}, 200),
    ("completions", {"model": ["list"], "prompt": "Hi"}, 400),
    ("completions", {"model": "other", "prompt": "Hi"}, 404),
    ("chat/completions", {"messages": [{"role": "user", "content": "{{ raise_exception('x') }}"}],
                          "max_tokens": 2}, 200),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("chat/completions", {"messages": [{"role": "user"}], "max_tokens": 2}, 200),
    ("chat/completions", {"messages": [{"role": 5, "content": "Hi"}]}, 400),
    ("chat/completions", {"messages": "Hi"}, 400),
    ("chat/completions", {"messages": [[]]}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 99}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                          "response_format": {"type": "json_schema", "json_schema": "x"}}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(" * 5000}}}}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                          "response_format": {"type": "json_object"}}, 200),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                          "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}] * 1,
        "tool_choice": "required", "max_tokens": 3}, 200),
    ("chat/completions", {"messages": [{"role": "tool", "content": "{{ 7*7 }}"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "not json"}}]}]}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "required"}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]}, 400),
]
RAW = [  # bodies that are not plain JSON objects
    ("completions", b'{"model": "%s", "prompt": "Hi", "temperature": NaN}' % MODEL.encode(), 400),
    ("completions", b'{"model": "%s", "prompt": "Hi", "top_p": Infinity}' % MODEL.encode(), 400),
    ("completions", b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode(), 400),
    ("chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL.encode(),
     400),
    ("embeddings", b'{"model": "%s", "input": "\\ud800"}' % MODEL.encode(), 400),
    ("completions", b'{"model": "%s", "prompt": "\xff\xfe invalid utf-8"}' % MODEL.encode(), 400),
    ("completions", b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("completions", b"[1, 2, 3]", 400),
    ("completions", b'"just a string"', 400),
    ("completions", b"", 400),
    ("completions", b'{"model": "%s", "prompt": "Hi"' % MODEL.encode(), 400),
]


@pytest.mark.parametrize("route, body, status", HOSTILE, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(HOSTILE)])
def test_hostile_json_bodies_get_their_status_and_hurt_nothing(server, route, body, status):
    before = workers(server)
    response = raw(route, json.dumps({"model": MODEL, **body}).encode(), server)
    assert response.status_code == status, response.text[:500]
    if status != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert httpx.post(f"{server}/v1/completions", json=CANARY, timeout=60).status_code == 200
    assert workers(server) == before  # no worker died or was restarted


@pytest.mark.parametrize("route, body, status", RAW, ids=[f"raw-{i}" for i in range(len(RAW))])
def test_hostile_raw_bodies_get_400_and_hurt_nothing(server, route, body, status):
    before = workers(server)
    response = raw(route, body, server)
    assert response.status_code == status, response.text[:500]
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{server}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    assert workers(server) == before


def test_lone_surrogate_is_a_400_naming_the_field(server):
    response = raw("completions", b'{"model": "%s", "prompt": ["ok", "a\\ud800"]}' % MODEL.encode(), server)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt.1"
    assert "Unicode" in response.json()["error"]["message"]


def test_schemathesis_finds_no_server_error_on_the_generation_routes(server):
    """Property-based requests from the server's own OpenAPI schema against both generation routes."""
    require_package("schemathesis", "pip install schemathesis")
    st = Path(sys.executable).with_name("st")
    result = subprocess.run(
        [str(st), "run", f"{server}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "25",
         "--seed", "1", "--include-path-regex", "/v1/(chat/)?completions", "--request-timeout", "120"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env=dict(os.environ, SCHEMATHESIS_HOOKS="tests.schemathesis_hooks", PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stdout[-4000:]
    summary = result.stdout.split("Test cases:")[-1]
    assert " passed" in summary and "failed" not in summary, result.stdout[-3000:]
    assert httpx.post(f"{server}/v1/completions", json=CANARY, timeout=60).status_code == 200

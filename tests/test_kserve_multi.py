"""One real server holding MiniLM and SmolLM2: the openai client embeds with one and chats with the
other; tritonclient speaks KServe v2 to it (readiness, metadata, infer with and without binary data);
/tokenize and /detokenize follow vLLM's shapes."""

import json

import httpx
import numpy as np
import pytest

from tests.conftest import require_package, run_cli
from trtserve.testing.server import start_server, stop_server

pytestmark = pytest.mark.models
KEY = "kserve-key"
ENCODER, DECODER = "all-MiniLM-L6-v2", "small"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["The capital of France is Paris.", "Anarchism is a political philosophy that is skeptical of authority."]


def key() -> dict:
    """The API key header, a fresh dict per tritonclient call: the client adds its own headers to it."""
    return dict(AUTH)


@pytest.fixture(scope="module")
def server(engines, tmp_path_factory):
    """MiniLM given as an engine dir (served under its manifest's id), SmolLM2 from a model repository
    (served under its folder's name)."""
    repository = tmp_path_factory.mktemp("repository")
    (repository / DECODER).symlink_to(engines["smollm2"], target_is_directory=True)
    proc, url = start_server(engines["minilm"], "--model-repository", str(repository), "--api-key", KEY,
                             "--max-queue", "16")
    yield url
    stop_server(proc)


@pytest.fixture()
def triton(server):
    require_package("tritonclient", "pip install 'tritonclient[http]'")
    import tritonclient.http as http

    return http.InferenceServerClient(server.removeprefix("http://"), network_timeout=120.0)


def test_openai_client_embeds_with_one_engine_and_chats_with_the_other(server):
    require_package("openai", "pip install openai")
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [ENCODER, DECODER]
    embedded = client.embeddings.create(model=ENCODER, input=TEXTS)
    assert len(embedded.data) == 2 and len(embedded.data[0].embedding) == 384
    chat = client.chat.completions.create(model=DECODER, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert chat.choices[0].message.content and chat.model == DECODER
    with pytest.raises(openai.NotFoundError, match=f"`{ENCODER}`, `{DECODER}`"):
        client.embeddings.create(model="gpt-4", input="x")
    with pytest.raises(openai.BadRequestError, match="encoder engine"):
        client.chat.completions.create(model=ENCODER, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="decoder engine"):
        client.embeddings.create(model=DECODER, input="x")


def test_health_is_per_engine_and_metrics_carry_the_model(server):
    health = httpx.get(f"{server}/health", headers=AUTH).json()
    assert health["status"] == "ok" and set(health["models"]) == {ENCODER, DECODER}
    assert health["models"][DECODER]["kind"] == "decoder" and health["models"][ENCODER]["workers"][0]["ready"]
    assert "workers" not in httpx.get(f"{server}/health").json()["models"][ENCODER]  # pids are the operator's
    text = httpx.get(f"{server}/metrics").text
    assert f'trtserve_workers_ready{{model="{ENCODER}"}} 1.0' in text
    assert f'trtserve_workers_ready{{model="{DECODER}"}} 1.0' in text


def test_tritonclient_readiness_and_metadata(triton, engines):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready(ENCODER, headers=key()) and triton.is_model_ready(ENCODER, "1", headers=key())
    assert triton.is_model_ready(DECODER, headers=key()) and not triton.is_model_ready(DECODER)  # no key: 401
    assert not triton.is_model_ready("nope", headers=key())
    assert not triton.is_model_ready(ENCODER, "2", headers=key())
    assert "binary_tensor_data" in triton.get_server_metadata(headers=key())["extensions"]
    meta = triton.get_model_metadata(ENCODER, "1", headers=key())
    manifest = json.loads((engines["minilm"] / "manifest.json").read_text())
    assert [i["name"] for i in meta["inputs"]] == [i["name"] for i in manifest["io"]["inputs"]]
    assert {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]} == {
        "last_hidden_state": ("FP32", [-1, -1, 384]), "sentence_embedding": ("FP32", [-1, 384])}
    assert meta["versions"] == ["1"] and meta["inputs"][0]["datatype"] == "INT64"


def _inputs(http, ids, mask, binary):
    tensors = []
    for name, value in (("input_ids", ids), ("attention_mask", mask)):
        tensor = http.InferInput(name, list(value.shape), "INT64")
        tensor.set_data_from_numpy(value, binary_data=binary)
        tensors.append(tensor)
    return tensors


def _padded(server, texts):
    rows = [httpx.post(f"{server}/tokenize", headers=AUTH, json={"model": ENCODER, "prompt": t}).json()["tokens"]
            for t in texts]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int64)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return ids, mask


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_infer_equals_v1_embeddings(server, triton, binary):
    import tritonclient.http as http

    ids, mask = _padded(server, TEXTS)
    outputs = [http.InferRequestedOutput(name, binary_data=binary) for name in ("sentence_embedding",
                                                                                 "last_hidden_state")]
    result = triton.infer(ENCODER, _inputs(http, ids, mask, binary), outputs=outputs, request_id="r-1",
                          headers=key())
    assert result.get_response()["id"] == "r-1" and result.get_response()["model_name"] == ENCODER
    embedding, hidden = result.as_numpy("sentence_embedding"), result.as_numpy("last_hidden_state")
    served = httpx.post(f"{server}/v1/embeddings", headers=AUTH, json={"model": ENCODER, "input": TEXTS}).json()
    expected = np.array([d["embedding"] for d in served["data"]], np.float32)
    assert embedding.shape == (2, 384) and np.max(np.abs(embedding - expected)) < 1e-6
    assert hidden.shape == (2, ids.shape[1], 384) and hidden.dtype == np.float32
    short = int(mask[0].sum())
    assert not hidden[0, short:].any() and np.abs(hidden[0, :short]).min(axis=1).max() > 0  # padding is zero
    # no outputs named: all of them, as binary data
    default = triton.infer(ENCODER, _inputs(http, ids, mask, binary), headers=key())
    assert np.array_equal(default.as_numpy("sentence_embedding"), embedding)


def _v2_error(response, status, match):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and match in body["error"], body


def test_bad_tensors_get_400_in_the_protocol_shape(server, triton):
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    ids, mask = _padded(server, TEXTS)
    as_float = http.InferInput("input_ids", list(ids.shape), "FP32")
    as_float.set_data_from_numpy(ids.astype(np.float32))
    with pytest.raises(InferenceServerException, match="takes INT64") as caught:
        triton.infer(ENCODER, [as_float], headers=key())
    assert caught.value.status() == "400"
    url = f"{server}/v2/models/{ENCODER}/infer"

    def infer(inputs, **extra):
        return httpx.post(url, headers=AUTH, json={"inputs": inputs, **extra})

    row = {"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [101, 2000, 102]}
    _v2_error(infer([{**row, "name": "token_ids"}]), 400, "unknown input `token_ids`")
    _v2_error(infer([{**row, "shape": [1, 4]}]), 400, "takes 4")
    _v2_error(infer([row, {**row, "name": "attention_mask", "shape": [3, 1]}]), 400, "[batch, sequence]")
    _v2_error(infer([{**row, "data": [101, 99999999, 102]}]), 400, "input_ids must be in [0, 30522)")
    _v2_error(infer([{**row, "data": [1.5, 2, 3]}]), 400, "not INT64")
    _v2_error(infer([row], outputs=[{"name": "logits"}]), 400, "unknown output `logits`")
    _v2_error(infer([{**row, "shape": [1, 600], "data": [101] * 600}]), 400, "limit is 512")
    _v2_error(infer([{**row, "shape": [17, 1], "data": [101] * 17}]), 400, "at most 16")
    _v2_error(infer([row, {**row, "name": "attention_mask", "data": [0, 1, 1]}]), 400, "1s then 0s")
    head = json.dumps({"inputs": [{**row, "data": None, "parameters": {"binary_data_size": 24}}]}).encode()
    short = httpx.post(url, headers={**AUTH, "Inference-Header-Content-Length": str(len(head))},
                       content=head + b"\0" * 16)
    _v2_error(short, 400, "ends before")
    _v2_error(httpx.post(url, headers=AUTH, content=b"{"), 400, "JSON")
    _v2_error(httpx.post(url, headers=AUTH, content=b"x" * (3 * 1024 * 1024)), 413, "limit")
    _v2_error(httpx.post(url, json={"inputs": [row]}), 401, "API key")
    _v2_error(httpx.post(f"{server}/v2/models/{DECODER}/infer", headers=AUTH, json={"inputs": [row]}), 400,
              "decoder engine")
    _v2_error(httpx.get(f"{server}/v2/models/nope", headers=AUTH), 404, f"`{ENCODER}`, `{DECODER}`")
    _v2_error(httpx.get(f"{server}/v2/models/{ENCODER}/versions/7", headers=AUTH), 404, "version 1 only")
    assert httpx.get(f"{server}/v2/health/live").status_code == 200  # probes need no key, like /health
    assert httpx.get(f"{server}/health").status_code == 200  # and the server serves on


def test_tokenize_and_detokenize_in_vllms_shapes(server):
    def post(path, body):
        response = httpx.post(f"{server}{path}", headers=AUTH, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = post("/tokenize", {"model": DECODER, "messages": messages, "return_token_strs": True})
    assert set(chat) == {"count", "max_model_len", "tokens", "token_strs"} and chat["count"] == len(chat["tokens"])
    assert len(chat["token_strs"]) == chat["count"] and chat["max_model_len"] == 2048
    answer = post("/v1/chat/completions", {"model": DECODER, "messages": messages, "max_tokens": 1})
    assert answer["usage"]["prompt_tokens"] == chat["count"]  # the same prompt the chat route generates from
    plain = post("/tokenize", {"model": ENCODER, "prompt": "Paris is lovely."})
    assert plain["tokens"][0] == 101 and plain["tokens"][-1] == 102 and plain["token_strs"] is None
    bare = post("/tokenize", {"model": ENCODER, "prompt": "Paris is lovely.", "add_special_tokens": False})
    assert bare["tokens"] == plain["tokens"][1:-1]
    text = "The Eiffel Tower is in Paris."
    ids = post("/tokenize", {"model": DECODER, "prompt": text})["tokens"]
    assert post("/detokenize", {"model": DECODER, "tokens": ids}) == {"prompt": text}
    bad = httpx.post(f"{server}/detokenize", headers=AUTH, json={"model": DECODER, "tokens": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    unnamed = httpx.post(f"{server}/tokenize", headers=AUTH, json={"prompt": "x"})
    assert unnamed.status_code == 400 and "give `model`" in unnamed.json()["error"]["message"]


def test_two_engines_under_one_name_are_refused_before_anything_starts(engines):
    result = run_cli("serve", str(engines["minilm"]), str(engines["minilm"]), timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"two engines would be served as `{ENCODER}`" in result.stderr and "NAME=DIR" in result.stderr
    named = run_cli("serve", str(engines["minilm"]), f"other={engines['minilm']}", "--served-model-name", "x",
                    timeout=120)
    assert named.returncode != 0 and "--served-model-name names one engine" in named.stderr

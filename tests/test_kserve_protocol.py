"""KServe v2 request parsing and answer layout (server/kserve.py), without a server."""

import gzip
import json
import zlib

import numpy as np
import pytest

from trtserve.server.errors import BadRequest, PayloadTooLarge
from trtserve.server.kserve import InferRequest, _decoded, parse, requested_outputs, response

IDS = {"name": "input_ids", "datatype": "INT64", "shape": [2, 2]}


def binary(inputs: list[tuple[dict, np.ndarray]], **extra) -> tuple[bytes, str]:
    head = json.dumps({"inputs": [{**spec, "parameters": {"binary_data_size": value.nbytes}}
                                  for spec, value in inputs], **extra}).encode()
    return head + b"".join(value.tobytes() for _, value in inputs), str(len(head))


def test_json_and_binary_tensors_decode_to_the_same_arrays():
    ids = np.array([[1, 2], [3, 4]], np.int64)
    _, from_json = parse(json.dumps({"inputs": [{**IDS, "data": [[1, 2], [3, 4]]}]}).encode(), None)
    mask = np.array([[1, 1], [1, 0]], np.int32)
    body, length = binary([(IDS, ids), ({"name": "attention_mask", "datatype": "INT32", "shape": [2, 2]}, mask)])
    _, from_binary = parse(body, length)
    assert np.array_equal(from_json["input_ids"], ids) and from_json["input_ids"].dtype == np.int64
    assert np.array_equal(from_binary["input_ids"], ids) and np.array_equal(from_binary["attention_mask"], mask)


@pytest.mark.parametrize("body, length, message", [
    (b'{"inputs": []}', None, "inputs"),
    (json.dumps({"inputs": [{**IDS, "data": [1, 2, 3]}]}).encode(), None, "has 3 values; shape [2, 2] takes 4"),
    (json.dumps({"inputs": [{**IDS, "data": [[1, 2], [3]]}]}).encode(), None, "ragged"),
    (json.dumps({"inputs": [{**IDS, "data": ["a", "b", "c", "d"]}]}).encode(), None, "not INT64"),
    (json.dumps({"inputs": [{**IDS, "data": [1, 2, 3, 2**70]}]}).encode(), None, "not INT64"),
    (json.dumps({"inputs": [{**IDS, "datatype": "INT8", "data": [1, 2, 3, 300]}]}).encode(), None, "range of INT8"),
    (json.dumps({"inputs": [{**IDS, "datatype": "BYTES", "data": ["a"] * 4}]}).encode(), None, "'BYTES'"),
    (json.dumps({"inputs": [{**IDS, "shape": [-1, 4], "data": [1] * 4}]}).encode(), None, "negative"),
    (json.dumps({"inputs": [{**IDS, "data": [1] * 4}, {**IDS, "data": [1] * 4}]}).encode(), None, "given twice"),
    (json.dumps({"inputs": [IDS]}).encode(), None, "neither `data` nor"),
    (json.dumps({"inputs": [{**IDS, "data": [1] * 4}], "color": 1}).encode(), None, "color"),
    (b"{}", "9", "Inference-Header-Content-Length"),
    (b"{}", "x", "Inference-Header-Content-Length"),
    (b"{}", "\u00b2", "Inference-Header-Content-Length"),  # a digit to str.isdigit, not to int()
])
def test_bad_requests_name_what_is_wrong(body, length, message):
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse(body, length)


def test_binary_sizes_must_match_the_shape_and_the_body():
    ids = np.arange(4, dtype=np.int64).reshape(2, 2)
    body, length = binary([(IDS, ids)])
    with pytest.raises(BadRequest, match="ends before"):
        parse(body[:-1], length)
    with pytest.raises(BadRequest, match="no input claims"):
        parse(body + b"\0", length)
    wrong, length = binary([({**IDS, "shape": [2, 3]}, ids)])
    with pytest.raises(BadRequest, match="takes 48 bytes"):
        parse(wrong, length)


def test_compressed_bodies_inflate_within_the_limit():
    body = json.dumps({"inputs": [{**IDS, "data": [1, 2, 3, 4]}]}).encode()
    assert _decoded(gzip.compress(body), "gzip", 10_000) == body
    assert _decoded(zlib.compress(body), "deflate", 10_000) == body
    with pytest.raises(PayloadTooLarge):
        _decoded(gzip.compress(b"0" * 100_000), "gzip", 10_000)  # a small body that inflates past the limit
    with pytest.raises(BadRequest, match="br"):
        _decoded(body, "br", 10_000)
    with pytest.raises(BadRequest, match="does not inflate"):
        _decoded(b"not gzip", "gzip", 10_000)


def test_outputs_default_to_all_and_binary_blobs_follow_their_order():
    request = InferRequest.model_validate({"inputs": [{**IDS, "data": [1] * 4}],
                                           "outputs": [{"name": "sentence_embedding", "parameters":
                                                        {"binary_data": True}}, {"name": "last_hidden_state"}]})
    wanted = requested_outputs(request)
    assert wanted == [("sentence_embedding", True), ("last_hidden_state", False)]
    everything = InferRequest.model_validate({"inputs": [{**IDS, "data": [1] * 4}],
                                              "parameters": {"binary_data_output": True}})
    assert requested_outputs(everything) == [("last_hidden_state", True), ("sentence_embedding", True)]
    tensors = {"sentence_embedding": np.ones((2, 3), np.float32), "last_hidden_state": np.zeros((2, 1, 3), np.float32)}
    head, blobs = response("m", "id-7", tensors, wanted)
    assert head["id"] == "id-7" and head["model_version"] == "1"
    assert head["outputs"][0] == {"name": "sentence_embedding", "datatype": "FP32", "shape": [2, 3],
                                  "parameters": {"binary_data_size": 24}}
    assert head["outputs"][1]["data"] == [0.0] * 6 and blobs == [tensors["sentence_embedding"].tobytes()]
    with pytest.raises(BadRequest, match="unknown output `logits`"):
        requested_outputs(InferRequest.model_validate({"inputs": [{**IDS, "data": [1] * 4}],
                                                       "outputs": [{"name": "logits"}]}))

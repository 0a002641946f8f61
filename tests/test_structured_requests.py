"""Which grammar a request asks for (server/structured.py), without a model."""

import pytest

from trtserve.server.errors import BadRequest
from trtserve.server.protocol import ChatCompletionRequest, CompletionRequest
from trtserve.server.structured import requested

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_schema", {"type": "object"}, "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}},
     ("json_schema", {"type": "integer"}, "response_format.json_schema.schema")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", ["a", "b"], "structured_outputs.choice")),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, ("json_schema", {"type": "string"},
                                                              "structured_outputs.json")),
    ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+", "guided_regex")),
    ({"guided_grammar": "start: \"x\""}, ("grammar", "start: \"x\"", "guided_grammar")),
])
def test_requested_grammars(extra, expected):
    assert requested(ChatCompletionRequest(**CHAT, **extra)) == expected


def test_completions_take_the_extra_body_forms():
    assert requested(CompletionRequest(model="m", prompt="x", guided_choice=["a"])) == ("choice", ["a"],
                                                                                        "guided_choice")
    with pytest.raises(BadRequest) as caught:  # an unchecked extra field on completions
        requested(CompletionRequest(model="m", prompt="x", response_format="json"))
    assert caught.value.param == "response_format"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"guided_json": "[" * 5000}, "guided_json"),  # deeper than json.loads goes
    ({"response_format": {"type": ["json_object"]}}, "response_format.type"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"tag": "x"}}, "structured_outputs.tag"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
])
def test_bad_requests_name_the_field(extra, param):
    with pytest.raises(BadRequest) as caught:
        requested(ChatCompletionRequest(**CHAT, **extra))
    assert caught.value.param == param

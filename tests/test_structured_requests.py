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


def _byte_tokenizer():
    """A byte-level tokenizer with one token per byte (no merges): every text is spelled byte by byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))} | {"<eos>": 256},
                                     merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _follows(grammar: str, text: str) -> bool | None:
    """True: `text` is a whole answer of the grammar; None: a prefix of one; False: the grammar refuses it."""
    import llguidance

    from trtserve.runtime.constraints import grammar_tokenizer

    tokenizer = _byte_tokenizer()
    matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer, 257, {256}), grammar, log_level=0)
    for token in tokenizer.encode(text).ids:
        if not matcher.consume_token(token):
            return False
    return True if matcher.is_accepting() else None


def test_a_json_schema_is_bounded_so_that_an_answer_ends_and_still_validates():
    """I-JSON's bounds where the schema sets none: integers and numbers within +-(2^53 - 1), numbers with at most
    9 decimals, whitespace runs of at most 32; vLLM's disable_any_whitespace, whitespace_pattern and
    disable_additional_properties; bounds the schema sets are its own."""
    pytest.importorskip("llguidance", reason="needs llguidance: pip install -e .[serve]")
    from trtserve.runtime.constraints import compile_grammar
    from trtserve.server.structured import json_options

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]},
                                               "big": {"type": "integer", "maximum": 10**18}},
              "required": ["n"]}
    bounded = compile_grammar("json_schema", schema)
    assert _follows(bounded, '{"n": 9007199254740991, "x": -0.125, "big": 100000000000000000}') is True
    assert _follows(bounded, '{"n": 90071992547409911') is False  # past 2^53 - 1: the digits must stop
    assert _follows(bounded, '{"n": 1, "x": 0.1234567891') is False  # a tenth decimal
    assert _follows(bounded, '{"n": 1' + " " * 32 + "}") is True
    assert _follows(bounded, '{"n": 1' + " " * 33) is False
    tight = compile_grammar("json_schema", schema, **json_options(ChatCompletionRequest(
        **CHAT, structured_outputs={"json": schema, "disable_any_whitespace": True})))
    assert _follows(tight, '{"n":1}') is True and _follows(tight, '{"n": 1}') is False
    patterned = compile_grammar("json_schema", schema, whitespace=r"\n?")
    assert _follows(patterned, '{\n"n":\n1}') is True and _follows(patterned, '{"n": 1}') is False
    closed = compile_grammar("json_schema", {"type": "object", "properties": {"a": {"type": "string"}}}, closed=True)
    assert _follows(closed, '{"a": "x"}') is True and _follows(closed, '{"b"') is False


@pytest.mark.parametrize("options, message", [
    ({"whitespace_pattern": ""}, "structured_outputs.whitespace_pattern must be a non-empty regex"),
    ({"disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace must be true or false"),
    ({"disable_any_whitespace": True, "whitespace_pattern": " ?"}, "not both"),
])
def test_structured_output_options_are_checked(options, message):
    from trtserve.server.structured import json_options

    with pytest.raises(BadRequest, match=message):
        json_options(ChatCompletionRequest(**CHAT, structured_outputs={"json": {"type": "object"}, **options}))


def test_a_property_named_type_is_a_property_not_a_type():
    pytest.importorskip("llguidance", reason="needs llguidance: pip install -e .[serve]")
    from trtserve.runtime.constraints import compile_grammar

    schema = {"type": "object", "properties": {"type": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["type", "n"]}
    grammar = compile_grammar("json_schema", schema)
    assert _follows(grammar, '{"type": "a", "n": 3}') is True and _follows(grammar, '{"type": 3') is False

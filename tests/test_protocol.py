"""Request validation at the HTTP boundary (no server needed): every field's range, NaN/Infinity
literals, invalid Unicode, stop strings, unserved features."""

import json

import pytest
from pydantic import ValidationError

from trtserve.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

BASE = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("field, value", [
    ("seed", 2**63), ("seed", -(2**63) - 1), ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0),
    ("top_k", -2), ("n", 0), ("max_tokens", 0), ("max_tokens", 2**64), ("logprobs", 21),
    ("presence_penalty", 3), ("stop", ""), ("stop", ["x" * 257]), ("prompt", [[-1]]), ("prompt", [2**63]),
    ("prompt", {"text": "hi"}), ("stream", "sometimes"), ("stream_options", 5),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("min_p", 1.5), ("min_p", -0.1), ("min_tokens", -1),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": -100.5}), ("logit_bias", [1]), ("logit_bias", {"5": "up"}),
    ("stop_token_ids", [-1]), ("stop_token_ids", "7"), ("stop_token_ids", list(range(1025))),
])
def test_out_of_range_and_wrong_type_fields_are_refused(field, value):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({**BASE, field: value})
    assert info.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_refused(literal):
    with pytest.raises(ValidationError, match="finite number"):
        CompletionRequest.model_validate(json.loads(f'{{"model": "m", "prompt": "hi", "temperature": {literal}}}'))


def test_lone_surrogates_are_refused_naming_the_field():
    bad = json.loads('"a\\ud800b"')
    cases = [(CompletionRequest, {**BASE, "prompt": bad}), (CompletionRequest, {**BASE, "stop": [bad]}),
             (EmbeddingRequest, {"model": "m", "input": [bad]}),
             (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": bad}]}),
             (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [
                 {"type": "text", "text": bad}]}]})]
    for model, body in cases:
        with pytest.raises(ValidationError, match="not valid Unicode|unable to parse raw data as a unicode string"):
            model.model_validate(body)


def test_extreme_but_valid_values_pass():
    request = CompletionRequest.model_validate({**BASE, "seed": -(2**63), "temperature": 0.0, "top_k": 10**12,
                                                "stop": ["x" * 256], "unknown_field": {"deep": [1]}})
    assert request.seed == -(2**63) and request.model_extra == {"unknown_field": {"deep": [1]}}


def test_union_errors_name_the_deepest_field_and_what_was_expected():
    from trtserve.server.app import _explain

    def explain(body):
        with pytest.raises(ValidationError) as info:
            CompletionRequest.model_validate({"model": "m", **body})
        return _explain(info.value.errors())

    assert explain({"prompt": [[1, -1]]}) == ("prompt.0.1", "Input should be greater than or equal to 0")
    where, message = explain({"prompt": {"a": 1}})
    assert where == "prompt" and "valid string" in message and "valid list" in message
    assert explain({"prompt": json.loads('"a\\ud800"')})[1].endswith("(a lone surrogate at character 1)")


def test_response_models_leave_out_what_openai_leaves_out_and_parse_in_the_official_client():
    """The typed responses dump to OpenAI's shapes: an empty delta is {}, a message without calls has no
    `tool_calls`, a call's message has `content: null`, a chunk carries `usage: null`; the openai package's
    own models read them back."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    from openai.types.chat import ChatCompletionChunk as OpenAIChunk

    from trtserve.server.protocol import (
        AssistantMessage,
        ChatChoice,
        ChatChunkChoice,
        ChatCompletionChunk,
        ChatCompletionResponse,
        ChatDelta,
        CompletionChoice,
        CompletionLogprobs,
        CompletionResponse,
        CompletionUsage,
        ToolCallDelta,
    )

    usage = CompletionUsage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    head = {"id": "x", "created": 1, "model": "m"}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = ChatCompletionResponse(**head, usage=usage, choices=[
        ChatChoice(index=0, message=AssistantMessage(content="hi"), logprobs=None, finish_reason="stop"),
        ChatChoice(index=1, message=AssistantMessage(content=None, tool_calls=[call]), logprobs=None,
                   finish_reason="tool_calls")]).model_dump()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == {"role": "assistant",
                                                                                      "content": "hi"}
    assert chat["choices"][1]["message"]["content"] is None and chat["choices"][1]["message"]["tool_calls"] == [call]
    assert ChatCompletion.model_validate(chat).choices[1].message.tool_calls[0].function.name == "f"
    chunks = [ChatCompletionChunk(**head, usage=None, choices=[ChatChunkChoice(index=0, delta=delta, logprobs=None,
                                                                               finish_reason=finish)]).model_dump()
              for delta, finish in [(ChatDelta(role="assistant", content=""), None), (ChatDelta(), "stop"),
                                    (ChatDelta(tool_calls=[ToolCallDelta(index=0, **call)]), None)]]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}, {}]
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in chunks)
    assert OpenAIChunk.model_validate(chunks[2]).choices[0].delta.tool_calls[0].index == 0
    text = CompletionResponse(**head, usage=usage, choices=[CompletionChoice(
        index=0, text=" a b", finish_reason="length", logprobs=CompletionLogprobs(
            tokens=[" a", " b"], token_logprobs=[-0.1, -0.5], top_logprobs=[{" a": -0.1}, {" b": -0.5}],
            text_offset=[0, 2]))])
    parsed = Completion.model_validate(json.loads(text.model_dump_json()))
    assert parsed.object == "text_completion" and parsed.choices[0].logprobs.token_logprobs == [-0.1, -0.5]
    # an echoed prompt's first token has no logprob: null, as vLLM answers (the openai package's type says float)
    assert CompletionLogprobs(tokens=["a"], token_logprobs=[None], top_logprobs=[None], text_offset=[0]).model_dump()[
        "token_logprobs"] == [None]


def test_fields_the_server_does_not_apply_are_refused_by_name_unless_neutral():
    from trtserve.server.errors import BadRequest
    from trtserve.server.unserved import refuse_unserved

    for neutral in ({"best_of": 1}, {"store": False}, {"modalities": ["text"]}, {"metadata": {"k": "v"}},
                    {"skip_special_tokens": True}, {"service_tier": "auto"}):
        refuse_unserved(CompletionRequest(**BASE, **neutral))
    for field, value, why in [("best_of", 3, "ask for `n` choices"), ("suffix", "end", "insertion"),
                              ("use_beam_search", True, "beam search"), ("store", True, "not stored"),
                              ("truncate_prompt_tokens", 5, "never truncated"),
                              ("chat_template", "{{ x }}", "--chat-template")]:
        with pytest.raises(BadRequest, match=why) as caught:
            refuse_unserved(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                                  **{field: value}))
        assert caught.value.param == field and f"`{field}` is not applied" in caught.value.message


def test_allowed_token_ids_leave_only_those_to_choose():
    import numpy as np

    from trtserve.runtime.sampling import Sampler, SamplingParams

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    assert Sampler(SamplingParams(temperature=0, allowed_token_ids=(2, 3)), 4).choose(logits)[0] == 2
    sampler = Sampler(SamplingParams(seed=1, allowed_token_ids=(1, 3)), 4)
    assert {sampler.choose(logits)[0] for _ in range(200)} == {1, 3}

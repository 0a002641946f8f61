"""Tool plans, prompts and calls (server/tools.py), without a model."""

import json

import pytest

from trtserve.server.errors import BadRequest
from trtserve.server.protocol import ChatCompletionRequest
from trtserve.server.tools import ToolPlan, calls_in, grammar_spec, messages_for, plan

ARGS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search", "parameters": ARGS}},
         {"type": "function", "function": {"name": "now"}}]


def chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})


def test_plans_follow_tool_choice():
    assert plan(chat()) is None and plan(chat(tools=TOOLS, tool_choice="none")) is None
    assert plan(chat(tools=TOOLS)).mode == "auto"
    named = plan(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}}))
    assert named.mode == "named" and named.named == "search"
    assert grammar_spec(named) == ("json_schema", ARGS, "tool_choice")
    required = grammar_spec(plan(chat(tools=TOOLS, tool_choice="required")))
    assert [c["properties"]["name"] for c in required[1]["anyOf"]] == [{"const": "search"}, {"const": "now"}]
    assert grammar_spec(plan(chat(tools=TOOLS))) is None  # auto: the model is free


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ["search"]}}},
     "tool_choice.function.name"),
])
def test_bad_plans_name_the_field(extra, param):
    with pytest.raises(BadRequest) as caught:
        plan(chat(**extra))
    assert caught.value.param == param


def test_calls_come_from_whole_json_answers_only():
    auto = plan(chat(tools=TOOLS))
    (call,) = calls_in(auto, '{"name": "search", "arguments": {"q": "Paris"}}')
    assert call["function"] == {"name": "search", "arguments": '{"q": "Paris"}'} and call["type"] == "function"
    assert calls_in(auto, "Paris is in France.") is None
    assert calls_in(auto, '{"name": "unknown", "arguments": {}}') is None
    assert calls_in(auto, '{"name": ["search"], "arguments": {}}') is None  # a model's odd answer is content
    assert calls_in(auto, "[" * 5000) is None
    named = ToolPlan("named", auto.tools, "search")
    assert json.loads(calls_in(named, '{"q": "x"}')[0]["function"]["arguments"]) == {"q": "x"}


def test_templates_without_tools_get_a_system_listing_and_plain_history():
    request = chat(tools=TOOLS, messages=[
        {"role": "user", "content": "find Paris"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "search", "arguments": '{"q": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a city"}])
    rendered = messages_for(request.messages, plan(request), template_takes_tools=False)
    assert rendered[0]["role"] == "system" and '"name": "search"' in rendered[0]["content"]
    assert json.loads(rendered[2]["content"]) == {"name": "search", "arguments": {"q": "Paris"}}
    assert rendered[3] == {"role": "user", "content": "Result of c1: a city"}
    native = messages_for(request.messages, plan(request), template_takes_tools=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"q": "Paris"} and native[2]["tool_call_id"] == "c1"
    with pytest.raises(BadRequest, match="role is 'user'"):
        messages_for(chat(messages=[{"role": "user", "tool_calls": [{}]}]).messages, None, False)

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


# answers in the forms the served families write calls in (Qwen's Hermes tags, Llama 3.1's JSON with
# "parameters", Mistral's [TOOL_CALLS] in its two tokenizer versions), as decoded with their special tokens
RECORDED = {
    "hermes": ('I will look.\n<tool_call>\n{"name": "search", "arguments": {"q": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "I will look."),
    "llama3_json": ('<|python_tag|>{"name": "search", "parameters": {"q": "Paris"}}; {"name": "now", '
                    '"parameters": {}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "search", "arguments": {"q": "Paris"}}, {"name": "now", "arguments": {}}]',
                None),
    "json": ('[{"name": "search", "arguments": {"q": "Paris"}}, {"name": "now", "arguments": "{}"}]', None),
}


@pytest.mark.parametrize("parser", sorted(RECORDED))
def test_each_familys_call_form_is_read_with_several_calls_and_the_text_before_them(parser):
    from trtserve.server.tools import read_answer

    raw, content = RECORDED[parser]
    auto = plan(chat(tools=TOOLS), parser)
    said, calls = read_answer(auto, raw, raw)
    assert said == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("search", {"q": "Paris"}), ("now", {})]
    assert len({c["id"] for c in calls}) == 2
    # Mistral's templates check a call id's length (9 letters and digits); the others get OpenAI's form
    assert all(len(c["id"]) == 9 and c["id"].isalnum() if parser == "mistral" else c["id"].startswith("call_")
               for c in calls)
    one = plan(chat(tools=TOOLS, parallel_tool_calls=False), parser)
    assert [c["function"]["name"] for c in calls_in(one, raw, raw)] == ["search"]  # parallel_tool_calls: false
    others = [p for p in RECORDED if p != parser and p != "json"]
    assert all(calls_in(plan(chat(tools=TOOLS), p), "Just text.", "Just text.") is None for p in others)


def test_mistral_newer_form_and_what_stays_content():
    from trtserve.server.tool_parsers import parse

    tools = {"search": {}, "now": {}}
    assert parse("mistral", 'Sure.[TOOL_CALLS]search[ARGS]{"q": "x"}[TOOL_CALLS]now[ARGS]{}', tools) == (
        "Sure.", [("search", {"q": "x"}), ("now", {})])
    assert parse("hermes", '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>', tools) is None
    assert parse("hermes", '<tool_call>{"name": "search", "arguments": [1]}</tool_call>', tools) is None
    assert parse("llama3_json", '{"name": "search", "parameters": {"q": 1}} trailing words', tools) is None
    assert parse("mistral", "[TOOL_CALLS]not json", tools) is None


@pytest.mark.parametrize(("template", "parser"), [
    ("{% for t in tools %}<tools>{{ t | tojson }}</tools>{% endfor %}<tool_call>", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ tools | tojson }}[/AVAILABLE_TOOLS] ... [TOOL_CALLS]", "mistral"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
     "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "json"),
])
def test_auto_reads_the_form_the_chat_template_teaches(template, parser):
    from trtserve.server.tool_parsers import parser_for

    assert parser_for(template) == parser
    assert parser_for(template, "hermes") == "hermes"

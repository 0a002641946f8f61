"""Structured outputs through the real server and the official openai client: SmolLM2's sampling is
constrained by llguidance inside the continuous batcher, so the answer parses and validates by
construction."""

from enum import StrEnum

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.conftest import require_package
from trtserve.testing.server import start_server, stop_server

pytestmark = pytest.mark.models
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Place(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class City(BaseModel):  # nested objects, an enum, an array, bounds that a 135M model needs to stop
    place: Place
    population: int = Field(ge=0, le=99_999_999)
    colors: list[Color] = Field(max_length=3)


@pytest.fixture(scope="module")
def server(engines):
    proc, url = start_server(engines["smollm2"])
    yield url
    stop_server(proc)


@pytest.fixture()
def client(server):
    require_package("openai", "pip install openai")
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _strict_schema() -> dict:
    from openai.lib._pydantic import to_strict_json_schema  # the schema `parse` sends

    return to_strict_json_schema(City)


def test_parse_returns_a_validated_object_and_streaming_agrees(client):
    require_package("jsonschema", "pip install jsonschema")
    import jsonschema

    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City, temperature=0,
                                           max_tokens=160)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    import json

    jsonschema.validate(json.loads(choice.message.content), _strict_schema())
    form = {"type": "json_schema", "json_schema": {"name": "City", "schema": _strict_schema(), "strict": True}}
    stream = client.chat.completions.create(model=MODEL, messages=ASK, response_format=form, temperature=0,
                                            max_tokens=160, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == choice.message.content  # greedy: the same tokens, streamed or not


def test_regex_choice_and_json_object_through_extra_body(client):
    import re

    year = client.completions.create(model=MODEL, prompt="The Eiffel Tower opened in the year", temperature=0,
                                     max_tokens=10, extra_body={"structured_outputs": {"regex": r" ?1[0-9]{3}"}})
    assert re.fullmatch(r" ?1[0-9]{3}", year.choices[0].text) and year.choices[0].finish_reason == "stop"
    answer = client.chat.completions.create(model=MODEL, temperature=0, extra_body={"guided_choice": ["yes", "no"]},
                                            messages=[{"role": "user", "content": "Is Paris in France?"}])
    assert answer.choices[0].message.content in ("yes", "no") and answer.choices[0].finish_reason == "stop"
    scored = client.chat.completions.create(model=MODEL, temperature=0, logprobs=True, top_logprobs=5,
                                            extra_body={"guided_choice": ["yes", "no"]},
                                            messages=[{"role": "user", "content": "Is Paris in France?"}])
    first = scored.choices[0].logprobs.content[0]  # only what the grammar allows, finite numbers
    assert scored.choices[0].message.content == answer.choices[0].message.content
    assert first.top_logprobs and all(t.logprob > -1e9 for t in first.top_logprobs)
    sampled = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_schema",
                                             "json_schema": {"name": "City", "schema": _strict_schema()}},
                                             temperature=1.0, seed=7, max_tokens=160)
    assert City.model_validate_json(sampled.choices[0].message.content)  # sampled, still inside the schema
    cut = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                         temperature=0, max_tokens=4)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("extra, field, message", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "not one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema", "`schema` object"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "does not compile"),
    ({"structured_outputs": {"ebnf": "x"}}, "structured_outputs.ebnf", "not served"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one structured output"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "cannot be combined"),
])
def test_bad_structured_outputs_are_400_naming_the_field(server, extra, field, message):
    response = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and message in error["message"], error
    assert httpx.get(f"{server}/health").status_code == 200


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
             "additionalProperties": False}}}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_and_required_tool_calls_return_valid_arguments_streamed_or_not(client):
    import json

    import jsonschema

    named = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, temperature=0,
                                           max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    required = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, temperature=0,
                                              max_tokens=60, tool_choice="required")
    (whole,) = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and whole.function.name in ("get_weather", "get_time")
    stream = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, temperature=0,
                                            max_tokens=60, tool_choice="required", stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(whole.function.name,
                                                                          whole.function.arguments)]
    assert chunks[-1].finish_reason == "tool_calls"
    # the call and its result go back into the history; the model answers on
    history = WEATHER_ASK + [
        {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function",
                                              "function": {"name": call.function.name,
                                                           "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert after.choices[0].message.content and after.choices[0].message.tool_calls is None


@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, extra, field):
    response = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": WEATHER_ASK, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.json()


class Town(BaseModel):  # what the report had: no bounds at all
    name: str
    country: str
    population: int


def test_parse_of_a_schema_with_an_unbounded_integer_finishes(client):
    """Unbounded, SmolLM2 writes the population's digits until max_tokens; bounded as I-JSON advises (integers
    within +-(2^53 - 1)), the answer ends and parses."""
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON: name, country, population."}],
        response_format=Town, temperature=0, max_tokens=120)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    city = choice.message.parsed
    assert isinstance(city, Town) and abs(city.population) <= 2**53 - 1

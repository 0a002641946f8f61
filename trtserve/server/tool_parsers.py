"""Tool calls in the forms the served families' models write them, read from a whole answer under
`tool_choice: auto` (a forced call is grammar-constrained JSON, server/tools.py):

- `json`: the answer is `{"name": ..., "arguments": {...}}` (or `"parameters"`), or a list of them;
- `hermes` (Qwen 2/2.5/3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more,
  after optional text;
- `llama3_json` (Llama 3.1-3.3): optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}`, several
  separated by `;`;
- `mistral`: optional text, then `[TOOL_CALLS]` and a JSON list of calls, or (newer tokenizers)
  `[TOOL_CALLS]name[ARGS]{...}` once per call.

`auto` picks the form from the chat template (its own markers), as the model was taught by it. An answer
that names a function not among the request's tools, or whose arguments are not an object, is content."""

from __future__ import annotations

import json
import re

PARSERS = ("json", "hermes", "llama3_json", "mistral")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parser_for(template: str | None, option: str = "auto") -> str:
    """The parser --tool-call-parser names, or (auto) the one the chat template's markers call for."""
    if option != "auto":
        return option
    text = template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or '"parameters"' in text:
        return "llama3_json"
    return "json"


def parse(parser: str, raw: str, tools: dict) -> tuple[str | None, list[tuple[str, dict]]] | None:
    """(content before the calls or None, [(name, arguments)]) of an answer (`raw`: decoded with its special
    tokens), or None when it holds no call to one of `tools`."""
    found = {"json": _json, "hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral}[parser](raw.strip())
    if not found:
        return None
    content, calls = found
    if not calls or any(name not in tools or not isinstance(arguments, dict) for name, arguments in calls):
        return None
    return (content or None), calls


def _call(value) -> tuple[str, object] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _loads(arguments)
    return value["name"], arguments


def _loads(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _calls(values) -> list | None:
    calls = [_call(v) for v in (values if isinstance(values, list) else [values])]
    return None if not calls or None in calls else calls


def _json(text: str):
    calls = _calls(_loads(text))
    return ("", calls) if calls else None


def _hermes(text: str):
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls = _calls([_loads(body) for body in _HERMES.findall(text[start:])])
    return (text[:start].strip(), calls) if calls else None


def _llama3(text: str):
    text = text.removeprefix("<|python_tag|>").strip()
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):
            return None
        values.append(value)
        while at < len(text) and text[at] in "; \n\t":
            at += 1
    calls = _calls(values) if values else None
    return ("", calls) if calls else None


def _mistral(text: str):
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    content, rest = text[:start].strip(), text[start:]
    if "[ARGS]" in rest:  # [TOOL_CALLS]name[ARGS]{...}, once per call
        calls: list | None
        calls = []
        for part in rest.split("[TOOL_CALLS]")[1:]:
            name, _, arguments = part.partition("[ARGS]")
            calls.append((name.strip(), _loads(arguments.strip())))
        return content, calls
    calls = _calls(_loads(rest.removeprefix("[TOOL_CALLS]").strip()))
    return (content, calls) if calls else None

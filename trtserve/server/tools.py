"""Tool calls for chat, in OpenAI's shapes: `tools` (functions with JSON-schema parameters) and
`tool_choice` (`none`, `auto`, `required`, or a named function).

- The tools reach the model through its chat template when the template takes `tools`; otherwise
  a system message lists them and asks for `{"name": ..., "arguments": {...}}` as the whole answer.
- `required` and a named function constrain decoding (server/structured.py, runtime/constraints.py):
  the answer is a call (any tool's, or the named one's arguments) by construction.
- `auto` leaves the model free: an answer in the form its family writes calls in
  (server/tool_parsers.py: plain JSON, Hermes `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`; chosen
  from the chat template or --tool-call-parser) naming the request's tools is a call, with any text
  before it as content; anything else is content. `parallel_tool_calls: false` keeps the first call.
- History: assistant messages with `tool_calls` and `role: "tool"` results are accepted and, for
  templates without tool support, rendered as the JSON call and a user turn with the result."""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trtserve.server.errors import BadRequest
from trtserve.server.protocol import content_text

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
INSTRUCTION = ("You can call these functions. To call one, answer with nothing but a JSON object "
               '{"name": <function name>, "arguments": <an object of its parameters>}. Functions:\n')


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    tools: dict  # name -> the function's definition (name, description, parameters)
    named: str | None = None
    parser: str = "json"  # how an `auto` answer's calls are read (server/tool_parsers.py)
    parallel: bool = True  # several calls in one answer (parallel_tool_calls); False keeps the first


def plan(request, parser: str = "json") -> ToolPlan | None:
    """The request's tool plan, or None when no tools take part (400 naming the field for bad ones); `parser`:
    the form `auto` answers are read in."""
    found = _plan(request)
    if found is None:
        return None
    return ToolPlan(found.mode, found.tools, found.named, parser, request.parallel_tool_calls is not False)


def _plan(request) -> ToolPlan | None:
    tools, choice = request.tools, request.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise BadRequest("`tool_choice` needs `tools`", param="tool_choice")
        return None
    functions = {}
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise BadRequest(f"{where}.function.name must be 1 to 64 letters, digits, _ or -",
                             param=f"{where}.function.name")
        if name in functions:
            raise BadRequest(f"two tools are named {name!r}", param=f"{where}.function.name")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise BadRequest(f"{where}.function.parameters must be a JSON schema object",
                             param=f"{where}.function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"{where}.function.description must be a string", param=f"{where}.function.description")
        functions[name] = {"name": name, "description": description or "", "parameters": parameters}
    if choice in (None, "auto"):
        return ToolPlan("auto", functions)
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan("required", functions)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
        if not isinstance(named, str) or named not in functions:
            raise BadRequest(f"tool_choice names {named!r}, which is not among the tools "
                             f"({', '.join(functions)})", param="tool_choice.function.name")
        return ToolPlan("named", functions, named)
    raise BadRequest("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                     "{\"name\": ...}}", param="tool_choice")


def grammar_spec(tool_plan: ToolPlan | None) -> tuple[str, object, str] | None:
    """What constrained decoding must produce: (kind, JSON schema, field) or None for `auto`."""
    if tool_plan is None or tool_plan.mode == "auto":
        return None
    if tool_plan.mode == "named":
        return "json_schema", tool_plan.tools[tool_plan.named]["parameters"], "tool_choice"
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for name, f in tool_plan.tools.items()]
    return "json_schema", {"anyOf": calls}, "tool_choice"


def messages_for(messages, tool_plan: ToolPlan | None, template_takes_tools: bool) -> list[dict]:
    """Chat messages as the template renders them, tool turns included."""
    out = []
    for i, m in enumerate(messages):
        content = content_text(m.content)
        calls = m.tool_calls or []
        if calls and m.role != "assistant":
            raise BadRequest(f"messages[{i}] has tool_calls but its role is {m.role!r}", param=f"messages.{i}")
        parsed = [_history_call(call, f"messages.{i}.tool_calls.{j}") for j, call in enumerate(calls)]
        if template_takes_tools:
            entry = {"role": m.role, "content": content}
            if parsed:  # with their ids: some templates check them (Mistral's: 9 characters)
                entry["tool_calls"] = [{"type": "function", "function": c, **({"id": call["id"]} if
                                        isinstance(call.get("id"), str) else {})} for c, call in zip(parsed, calls)]
            if m.tool_call_id:
                entry["tool_call_id"] = m.tool_call_id
            out.append(entry)
        elif m.role == "tool":
            label = m.name or m.tool_call_id or "the function"
            out.append({"role": "user", "content": f"Result of {label}: {content}"})
        else:
            text = "\n".join([content] * bool(content) + [json.dumps(c) for c in parsed])
            out.append({"role": m.role, "content": text})
    if tool_plan is not None and not template_takes_tools:
        listing = INSTRUCTION + "\n".join(json.dumps(f) for f in tool_plan.tools.values())
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _history_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                         param=where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            raise BadRequest(f"{where}.function.arguments is not a JSON string", param=f"{where}.function") from None
    return {"name": function["name"], "arguments": arguments}


def calls_in(tool_plan: ToolPlan, text: str, raw: str | None = None) -> list[dict] | None:
    """OpenAI tool_calls of a generated answer, or None when it is not a call (see read_answer)."""
    found = read_answer(tool_plan, text, raw)
    return None if found is None else found[1]


def read_answer(tool_plan: ToolPlan, text: str, raw: str | None = None) -> tuple[str | None, list[dict]] | None:
    """(content, OpenAI tool_calls) of a generated answer, or None when it is not a call (content). `raw`: the
    answer decoded with its special tokens (Mistral's `[TOOL_CALLS]` is one), for the `auto` parsers."""
    from trtserve.server.tool_parsers import parse

    calls: Sequence[tuple[str | None, Any]]  # arguments not yet checked to be an object where grammar-constrained
    if tool_plan.mode == "auto":
        found = parse(tool_plan.parser, raw if raw is not None else text, tool_plan.tools)
        if found is None:
            return None
        content, calls = found
    else:  # grammar-constrained JSON: the named function's arguments, or one {"name", "arguments"} object
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return None
        if tool_plan.mode == "named":
            content, calls = None, [(tool_plan.named, value)]
        elif isinstance(value, dict) and value.get("name") in tool_plan.tools:
            content, calls = None, [(value["name"], value.get("arguments"))]
        else:
            return None
        if not isinstance(calls[0][1], dict):
            return None
    if not tool_plan.parallel:
        calls = calls[:1]
    return content, [{"id": _call_id(tool_plan.parser), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                     for name, arguments in calls]


def _call_id(parser: str) -> str:
    """A new call's id: `call_` and 24 hex digits (OpenAI's form), or 9 letters and digits where the family's
    template checks for that (Mistral's)."""
    if parser == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"

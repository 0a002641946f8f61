"""Structured outputs on the request side: which grammar a request asks for, checked as a 400.

Chat takes OpenAI's `response_format` (`json_object`; `json_schema` with `name`, `schema`,
`strict`). Both routes take vLLM's extra-body forms: `structured_outputs` with one of `json`,
`regex`, `choice`, `grammar`, and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. The grammar is compiled and checked against the model's tokenizer here, so a bad
schema or regex is the caller's 400; the workers then constrain sampling (runtime/constraints.py)."""

from __future__ import annotations

import json

from trtserve.server.errors import BadRequest

LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
KIND = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def requested(request) -> tuple[str, object, str] | None:
    """(grammar kind, value, the field it came from), or None for free text."""
    asked = []
    response_format = getattr(request, "response_format", None)  # on completions: an extra field, unchecked
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise BadRequest("response_format must be an object with a `type`", param="response_format")
        kind = response_format.get("type", "text")
        if kind == "json_object":
            asked.append(("json_schema", {"type": "object"}, "response_format"))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise BadRequest("response_format.json_schema must be an object with a `schema` object (and a "
                                 "`name`)", param="response_format.json_schema")
            asked.append(("json_schema", spec.get("schema", {}), "response_format.json_schema.schema"))
        elif not isinstance(kind, str) or kind != "text":
            raise BadRequest(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                             param="response_format.type")
    extra = getattr(request, "structured_outputs", None)
    if extra is not None:
        given = [k for k in KIND if extra.get(k) is not None]
        unknown = sorted(set(extra) - set(KIND) - {"disable_fallback", "disable_any_whitespace",
                                                   "disable_additional_properties", "whitespace_pattern"})
        if unknown:
            raise BadRequest(f"structured_outputs.{unknown[0]} is not served; give one of json, regex, choice, "
                             "grammar", param=f"structured_outputs.{unknown[0]}")
        asked += [(KIND[k], extra[k], f"structured_outputs.{k}") for k in given]
    for field, kind in LEGACY.items():
        value = getattr(request, field, None)
        if value is not None:
            asked.append((KIND[kind], value, field))
    if not asked:
        return None
    if len(asked) > 1:
        raise BadRequest(f"give one structured output, not {len(asked)} ({', '.join(a[2] for a in asked)})",
                         param=asked[1][2])
    kind, value, field = asked[0]
    return kind, _checked(kind, value, field), field


def _checked(kind: str, value, field: str):
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise BadRequest(f"{field} is not valid JSON: {exc}", param=field) from None
        if not isinstance(value, (dict, bool)):
            raise BadRequest(f"{field} must be a JSON schema (an object)", param=field)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise BadRequest(f"{field} must be a non-empty list of non-empty strings", param=field)
    elif not isinstance(value, str) or not value:
        raise BadRequest(f"{field} must be a non-empty string", param=field)
    return value


def json_options(request) -> dict:
    """vLLM's structured_outputs options for a JSON schema: `disable_any_whitespace` (none between tokens),
    `whitespace_pattern` (a regex for it), `disable_additional_properties` (objects that do not say take no
    other properties). `disable_fallback` holds trivially: there is one grammar engine, never another."""
    extra = getattr(request, "structured_outputs", None) or {}
    pattern = extra.get("whitespace_pattern")
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise BadRequest("structured_outputs.whitespace_pattern must be a non-empty regex",
                         param="structured_outputs.whitespace_pattern")
    for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if not isinstance(extra.get(flag, False), bool):
            raise BadRequest(f"structured_outputs.{flag} must be true or false", param=f"structured_outputs.{flag}")
    if pattern is not None and extra.get("disable_any_whitespace"):
        raise BadRequest("give structured_outputs.whitespace_pattern or disable_any_whitespace, not both",
                         param="structured_outputs.whitespace_pattern")
    return {"whitespace": "" if extra.get("disable_any_whitespace") else pattern,
            "closed": bool(extra.get("disable_additional_properties"))}


def compile_for(service, kind: str, value, field: str, options: dict | None = None) -> str:
    """The llguidance grammar for this request, checked against the service's tokenizer (blocking); `options`:
    json_options' for a JSON schema."""
    from trtserve.runtime.constraints import GrammarError, check_grammar, compile_grammar

    options = options or {}
    if kind != "json_schema" and (options.get("whitespace") is not None or options.get("closed")):
        raise BadRequest(f"structured_outputs' whitespace and additional-properties options shape a JSON schema; "
                         f"{field} is not one", param=field)
    try:
        grammar = compile_grammar(kind, value, **options) if kind == "json_schema" else compile_grammar(kind, value)
        check_grammar(grammar, service.lltokenizer)
    except GrammarError as exc:
        raise BadRequest(f"{field} does not compile to a grammar: {exc}", param=field) from None
    return grammar

"""Grammar-constrained decoding with llguidance, on numpy logits (its numpy bitmask API; no torch):
a grammar (compiled from a JSON schema, a regex, a list of choices or a Lark grammar) gives, before
every token, the set of tokens that keep the output inside the grammar; the others get -inf. One
Constraint per sequence, held by its Sampler; once the grammar is complete only end-of-sequence is
allowed, so a constrained sequence ends with "stop" (or "length" when max_tokens cuts it first)."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, cast

import numpy as np

if TYPE_CHECKING:
    from llguidance import GrammarFormat, LLMatcher

KINDS = ("json_schema", "regex", "choice", "grammar")  # grammar: Lark or GBNF
MAX_GRAMMAR_CHARS = 200_000  # a compiled grammar this long costs about a second per matcher built
TEMPLATES = 32  # compiled matchers a worker keeps, one per grammar; each sequence gets a copy


class GrammarError(ValueError):
    """A grammar that does not compile, with llguidance's message."""


def compile_grammar(kind: str, value, whitespace: str | None = None, closed: bool = False) -> str:
    """llguidance's grammar text for a JSON schema (a dict, bounded: see bounded_schema), a regex, a list of
    strings, or a Lark or GBNF grammar."""
    import llguidance

    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")
    if kind == "json_schema":
        value = bounded_schema(value, whitespace, closed)
    text = json.dumps(value) if kind in ("json_schema", "choice") else value
    try:
        grammar = llguidance.grammar_from(cast("GrammarFormat", kind), text)  # one of KINDS
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # its Rust panics arrive as a BaseException
        raise GrammarError(str(exc).strip() or type(exc).__name__) from None
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"it compiles to {len(grammar)} characters of grammar; the limit is {MAX_GRAMMAR_CHARS}")
    return grammar


SAFE_INTEGER = 2**53 - 1  # I-JSON (RFC 7493): integers an IEEE double holds exactly
DECIMALS = 1e-9  # numbers: at most 9 digits after the point (and no exponent), so a number ends
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"  # at most 32 whitespace characters between two JSON tokens
_DATA = ("const", "enum", "default", "examples")  # values, not schemas


def bounded_schema(schema, whitespace: str | None = None, closed: bool = False):
    """`schema` with what it leaves unbounded bounded, so that a constrained answer always ends (an unbounded
    integer lets a small model write digits forever): integers and numbers without a bound within
    +-(2^53 - 1), numbers without `multipleOf` at most 9 decimals, and whitespace between tokens at most 32
    characters (`whitespace`: another pattern; "" for none at all). `closed`: objects without
    `additionalProperties` take no other properties. Whatever the answer, it validates against `schema`."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema
    schema = _bounded(schema, closed)
    if "x-guidance" not in schema:
        schema["x-guidance"] = ({"whitespace_flexible": False} if whitespace == "" else
                                {"whitespace_pattern": whitespace or WHITESPACE})
    return schema


def _bounded(node, closed: bool):
    if isinstance(node, list):
        return [_bounded(item, closed) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: value if key in _DATA else _bounded(value, closed) for key, value in node.items()}
    kinds = node.get("type")  # a schema's type: a name or a list of names (in a `properties` map, "type" can
    # be a property whose value is a schema: not a type)
    kinds = {kinds} if isinstance(kinds, str) else {k for k in kinds if isinstance(k, str)} \
        if isinstance(kinds, list) else set()
    if kinds & {"integer", "number"}:
        if "minimum" not in node and "exclusiveMinimum" not in node:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in node and "exclusiveMaximum" not in node:
            out["maximum"] = SAFE_INTEGER
        if "number" in kinds and "multipleOf" not in node:
            out["multipleOf"] = DECIMALS
    if closed and "object" in kinds and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def grammar_tokenizer(tokenizer, vocab: int, eos_ids) -> object:
    """llguidance's view of a `tokenizers.Tokenizer` for logits of width `vocab` (about 0.4 s: build once)."""
    import llguidance

    plain = tokenizer.__class__.from_str(tokenizer.to_str())
    plain.no_padding()
    plain.no_truncation()
    return llguidance.LLTokenizer(plain.to_str(), n_vocab=vocab, eos_token=sorted(eos_ids))


def check_grammar(grammar: str, lltokenizer) -> None:
    """GrammarError with llguidance's message when `grammar` cannot be matched against this tokenizer."""
    import llguidance

    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        problem = str(exc) or type(exc).__name__
    if problem:
        raise GrammarError(problem.strip())


def _guarded(call, *args):
    """llguidance's call; its Rust panics (a BaseException) become GrammarError, which ends one sequence."""
    try:
        return call(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except GrammarError:
        raise
    except BaseException as exc:
        raise GrammarError(f"the grammar engine failed: {str(exc).strip() or type(exc).__name__}") from None


class Constraint:
    """One sequence's grammar state: its own copy of the grammar's matcher."""

    def __init__(self, matcher, vocab: int):
        import llguidance.numpy as llnp

        self.matcher = matcher
        self.bitmask = llnp.allocate_token_bitmask(1, vocab)
        self._fill, self._apply = llnp.fill_next_token_bitmask, llnp.apply_token_bitmask_inplace

    def apply(self, logits: np.ndarray) -> None:
        """Disallowed tokens of this float32 row get -inf, in place."""
        _guarded(self._fill, self.matcher, self.bitmask, 0)
        _guarded(self._apply, logits, self.bitmask)

    def consume(self, token: int) -> None:
        if not self.matcher.is_stopped() and not _guarded(self.matcher.consume_token, token):
            raise GrammarError(f"token {token} breaks the grammar: {self.matcher.get_error()}")


class Constraints:
    """Constraint factory of one worker: the grammar tokenizer is built on first use and kept, and each
    grammar is compiled into a matcher once (the costly part) and copied for every sequence that uses it."""

    def __init__(self, tokenizer, vocab: int, eos_ids):
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, set(eos_ids)
        self._lltokenizer = None
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()

    @property
    def lltokenizer(self):
        if self._lltokenizer is None:
            self._lltokenizer = grammar_tokenizer(self.tokenizer, self.vocab, self.eos_ids)
        return self._lltokenizer

    def __call__(self, grammar: str) -> Constraint:
        import llguidance

        template = self._templates.get(grammar)
        if template is None:
            template = _guarded(llguidance.LLMatcher, self.lltokenizer, grammar)
            if template.is_error():
                raise GrammarError(template.get_error())
            self._templates[grammar] = template
            if len(self._templates) > TEMPLATES:
                self._templates.popitem(last=False)
        self._templates.move_to_end(grammar)
        return Constraint(_guarded(template.deep_copy), self.vocab)

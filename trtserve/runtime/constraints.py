"""Grammar-constrained decoding with llguidance, on numpy logits (its numpy bitmask API; no torch):
a grammar (compiled from a JSON schema, a regex, a list of choices or a Lark grammar) gives, before
every token, the set of tokens that keep the output inside the grammar; the others get -inf. One
Constraint per sequence, held by its Sampler; once the grammar is complete only end-of-sequence is
allowed, so a constrained sequence ends with "stop" (or "length" when max_tokens cuts it first)."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np

KINDS = ("json_schema", "regex", "choice", "grammar")  # grammar: Lark or GBNF
MAX_GRAMMAR_CHARS = 200_000  # a compiled grammar this long costs about a second per matcher built
TEMPLATES = 32  # compiled matchers a worker keeps, one per grammar; each sequence gets a copy


class GrammarError(ValueError):
    """A grammar that does not compile, with llguidance's message."""


def compile_grammar(kind: str, value) -> str:
    """llguidance's grammar text for a JSON schema (a dict), a regex, a list of strings, or a Lark or GBNF
    grammar."""
    import llguidance

    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")
    text = json.dumps(value) if kind in ("json_schema", "choice") else value
    try:
        grammar = llguidance.grammar_from(kind, text)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # its Rust panics arrive as a BaseException
        raise GrammarError(str(exc).strip() or type(exc).__name__) from None
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"it compiles to {len(grammar)} characters of grammar; the limit is {MAX_GRAMMAR_CHARS}")
    return grammar


def grammar_tokenizer(tokenizer, vocab: int, eos_ids) -> "object":
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
        self._templates: OrderedDict[str, object] = OrderedDict()

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

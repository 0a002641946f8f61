"""Grammar-constrained decoding with llguidance, on numpy logits (its numpy bitmask API; no torch):
a grammar (compiled from a JSON schema, a regex, a list of choices or a Lark grammar) gives, before
every token, the set of tokens that keep the output inside the grammar; the others get -inf. One
Constraint per sequence, held by its Sampler; once the grammar is complete only end-of-sequence is
allowed, so a constrained sequence ends with "stop" (or "length" when max_tokens cuts it first)."""

from __future__ import annotations

import json

import numpy as np

KINDS = ("json_schema", "regex", "choice", "grammar")  # grammar: Lark or GBNF


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
        return llguidance.grammar_from(kind, text)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # its Rust panics arrive as a BaseException
        raise GrammarError(str(exc).strip() or type(exc).__name__) from None


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


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, lltokenizer, grammar: str, vocab: int):
        import llguidance
        import llguidance.numpy as llnp

        self.matcher = llguidance.LLMatcher(lltokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.bitmask = llnp.allocate_token_bitmask(1, vocab)
        self._fill, self._apply = llnp.fill_next_token_bitmask, llnp.apply_token_bitmask_inplace

    def apply(self, logits: np.ndarray) -> None:
        """Disallowed tokens of this float32 row get -inf, in place."""
        self._fill(self.matcher, self.bitmask, 0)
        self._apply(logits, self.bitmask)

    def consume(self, token: int) -> None:
        if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} breaks the grammar: {self.matcher.get_error()}")


class Constraints:
    """Constraint factory of one worker: the grammar tokenizer is built on first use and kept."""

    def __init__(self, tokenizer, vocab: int, eos_ids):
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, set(eos_ids)
        self._lltokenizer = None

    @property
    def lltokenizer(self):
        if self._lltokenizer is None:
            self._lltokenizer = grammar_tokenizer(self.tokenizer, self.vocab, self.eos_ids)
        return self._lltokenizer

    def __call__(self, grammar: str) -> Constraint:
        return Constraint(self.lltokenizer, grammar, self.vocab)

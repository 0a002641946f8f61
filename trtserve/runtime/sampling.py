"""Next-token choice on logits, in numpy, per sequence, in vLLM's order: logit bias (OpenAI's), the end
tokens held back until `min_tokens`, the repetition penalty (Hugging Face's and vLLM's: over the prompt
and the generated tokens), presence/frequency penalties (OpenAI's formula: over the generated tokens),
a grammar's mask, then greedy or temperature with min-p, top-k and top-p; seeded generators, and
log-probabilities when asked.

A row of logits the model got wrong (NaN, +inf) raises SamplingError: the caller ends that one
sequence, never its neighbours."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import overload

import numpy as np

from trtserve.runtime.events import Failure, FinishReason

GREEDY_BELOW = 1e-5  # a temperature this small is greedy decoding (vLLM's rule): dividing by it overflows


class SamplingError(ValueError):
    """This sequence cannot go on (its logits are not numbers, or the request rules out every token)."""


class RuledOut(SamplingError):
    """The request's own fields leave no token to choose: the caller's error, not the server's."""

    failure = Failure.RULED_OUT


# the request's own fields leave no token to choose: the caller's error, not the server's
RULED_OUT = ("no token is left to choose: the request's allowed_token_ids, min_tokens, logit_bias or grammar "
             "rule out every token the model has here")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the top k
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks; vLLM's extension)
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and the top k
    grammar: str | None = None  # llguidance grammar the output must follow (runtime/constraints.py)
    repetition_penalty: float = 1.0  # > 0; 1: off. A seen token's logit l becomes l / p if l > 0, else l * p
    min_p: float = 0.0  # tokens less likely than min_p x the likeliest are not sampled; 0: off
    min_tokens: int = 0  # end tokens (end-of-sequence, stop_token_ids) cannot be chosen before this many
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the sequence like end-of-sequence (not emitted)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to the logits, OpenAI's -100..100
    allowed_token_ids: tuple[int, ...] = ()  # only these may be chosen (vLLM's); empty: any

    def to_dict(self) -> dict:
        return asdict(self)


def finish_reason(token: int, params: SamplingParams, eos_ids, generated: int, length: int,
                  max_seq: int) -> FinishReason | None:
    """Whether a sequence ends on the token just chosen, for every decode loop: STOP for an end-of-sequence
    token (unless `ignore_eos`; the token itself is not emitted), LENGTH once `max_tokens` are generated or the
    context is full, else None. `generated` and `length` (prompt plus generated tokens) count the chosen token."""
    if (token in eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
        return FinishReason.STOP
    if generated >= params.max_tokens or length >= max_seq:
        return FinishReason.LENGTH
    return None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Over the last axis (one row of logits, or a (S, V) block)."""
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def prompt_logprobs(prompt: list[int], logits: np.ndarray,
                    top: int) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
    """(token, logprob, top logprobs) of every prompt token under the (S, V) logits of the prompt's
    own positions: token i is scored by position i - 1; the first has no logprob (None, None)."""
    logp = log_softmax(logits[:-1].astype(np.float32))  # (S-1, V)
    if not np.isfinite(logp.max(axis=-1)).all() or np.isnan(logp).any():
        raise SamplingError("the model's logits for this prompt are not finite numbers (NaN or inf)")
    rows: list[tuple[int, float | None, list[tuple[int, float]] | None]] = [(prompt[0], None, None)]
    for i, token in enumerate(prompt[1:]):
        best: np.ndarray | list[int] = np.argsort(-logp[i])[:top] if top else []
        rows.append((int(token), float(logp[i, token]), [(int(t), float(logp[i, t])) for t in best]))
    return rows


WHOLE_BLOCK = 256  # tokens per block when drawing from the whole vocabulary
NUCLEUS_CANDIDATES = 256  # top-p sorts the likeliest this many first, the whole vocabulary only if they fall short


def _falling(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """`tokens` ordered by falling logit."""
    return tokens[np.argsort(-logits[tokens], kind="stable")]


def _likeliest(logits: np.ndarray, k: int) -> np.ndarray:
    """The k tokens of the largest logits, by falling logit (a partition of the values, then a sort of k)."""
    threshold = np.partition(logits, logits.size - k)[logits.size - k]
    return _falling(logits, np.flatnonzero(logits >= threshold))[:k]


class Sampler:
    """One per sequence: its own random generator (seeded for reproducible output), token counts, and
    the grammar constraint when the sequence has one."""

    def __init__(self, params: SamplingParams, vocab: int, constraint=None, prompt=(), eos_ids=()):
        self.params, self.vocab, self.constraint = params, vocab, constraint
        # any 64-bit seed, negative ones included (numpy's generators take non-negative seeds only)
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.counts: np.ndarray | None = None  # token counts for the penalties, made on first use
        self.generated = 0
        self.seen = None  # the prompt's and the generated tokens, for the repetition penalty
        if params.repetition_penalty != 1.0:
            self.seen = np.zeros(vocab, dtype=bool)
            self.seen[np.asarray(prompt, dtype=np.int64)] = True
        self.bias = None
        if params.logit_bias:
            tokens, values = zip(*params.logit_bias)
            self.bias = (np.asarray(tokens, dtype=np.int64), np.asarray(values, dtype=np.float32))
        self.barred = None  # the tokens outside allowed_token_ids
        if params.allowed_token_ids:
            self.barred = np.ones(vocab, dtype=bool)
            self.barred[np.asarray(params.allowed_token_ids, dtype=np.int64)] = False
        ends = set()  # held back until min_tokens: end-of-sequence (unless ignored) and stop_token_ids
        if params.min_tokens:
            ends = (set() if params.ignore_eos else set(eos_ids)) | set(params.stop_token_ids)
        self.ends = np.asarray(sorted(ends), dtype=np.int64)

    def choose(self, logits: np.ndarray) -> tuple[int, float | None, list[tuple[int, float]] | None]:
        """(token, its logprob or None, top logprobs or None) from one row of logits."""
        p = self.params
        logits = logits.astype(np.float32, copy=True)
        top = float(np.max(logits)) if logits.size else float("nan")
        if not np.isfinite(top) or np.isnan(logits).any():
            raise SamplingError("the model's logits for this sequence are not finite numbers (NaN or inf); "
                                "the engine's precision may not suit this input")
        if self.barred is not None:
            logits[self.barred] = -np.inf
        if self.bias is not None:
            logits[self.bias[0]] += self.bias[1]
        if self.generated < p.min_tokens and self.ends.size:
            logits[self.ends] = -np.inf
        if self.seen is not None:
            seen = logits[self.seen]
            logits[self.seen] = np.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            if self.counts is None:
                self.counts = np.zeros(self.vocab, dtype=np.int32)
            logits -= p.presence_penalty * (self.counts > 0) + p.frequency_penalty * self.counts
        if self.constraint is not None:
            self.constraint.apply(logits)  # tokens outside the grammar: -inf
        if not np.isfinite(np.max(logits)):
            raise RuledOut(RULED_OUT)
        if p.temperature < GREEDY_BELOW or p.top_k == 1:
            token = int(np.argmax(logits))
        else:
            token = self._sample((logits - np.max(logits)) / p.temperature)
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True
        self.generated += 1
        if p.logprobs is None:
            return token, None, None
        logp = log_softmax(logits)
        best: np.ndarray | list[int] = np.argsort(-logp)[: p.logprobs] if p.logprobs else []
        # under a grammar, tokens it rules out are -inf: not alternatives, and not JSON numbers
        return token, float(logp[token]), [(int(t), float(logp[t])) for t in best if np.isfinite(logp[t])]

    def _sample(self, logits: np.ndarray) -> int:
        """A token from softmax(logits) after the cuts asked for (top-k, min-p, top-p, in that order; each keeps
        a prefix of the tokens by falling probability). Only what a cut can keep is sorted."""
        p = self.params
        if not p.top_k and not p.min_p and p.top_p >= 1.0:  # the whole vocabulary: no order needed
            return self._draw_whole(logits)
        if p.top_k and p.top_k < logits.size:
            return self._draw(logits, _likeliest(logits, p.top_k))
        if p.min_p:  # what min-p can keep (a margin below its bound; _draw applies the bound itself)
            bound = np.max(logits) + np.log(p.min_p) - 1e-3
            return self._draw(logits, _falling(logits, np.flatnonzero(logits >= bound)))
        if p.top_p < 1.0 and logits.size > NUCLEUS_CANDIDATES:
            candidates = _likeliest(logits, NUCLEUS_CANDIDATES)
            total = float(np.sum(np.exp(logits - logits[candidates[0]]), dtype=np.float64))
            token = self._draw(logits, candidates, total)
            if token is not None:
                return token
        return self._draw(logits, np.argsort(-logits))

    def _draw_whole(self, logits: np.ndarray) -> int:
        """A token from softmax(logits) over the whole vocabulary by its inverse distribution function, in two
        levels: a block of WHOLE_BLOCK tokens by the blocks' masses, then a token inside it (two short cumulative
        sums where one over the vocabulary would be ten times slower). Tokens of weight 0 are never drawn."""
        weights = np.exp(logits - np.max(logits))  # float32, vectorized; masked tokens weigh 0
        if weights.size % WHOLE_BLOCK:
            weights = np.concatenate([weights, np.zeros(-weights.size % WHOLE_BLOCK, weights.dtype)])
        blocks = weights.reshape(-1, WHOLE_BLOCK)
        masses = blocks.sum(axis=1, dtype=np.float64)
        through = np.cumsum(masses)
        target = self.rng.random() * through[-1]
        b = int(np.searchsorted(through, target, side="right"))
        if b == masses.size:  # rounding at the very end
            b = int(np.flatnonzero(masses)[-1])
        inside = np.cumsum(blocks[b], dtype=np.float64)
        i = int(np.searchsorted(inside, max(target - (through[b] - masses[b]), 0.0), side="right"))
        if i == WHOLE_BLOCK:
            i = int(np.flatnonzero(blocks[b])[-1])
        return b * WHOLE_BLOCK + i

    @overload
    def _draw(self, logits: np.ndarray, order: np.ndarray, total: None = None) -> int: ...

    @overload
    def _draw(self, logits: np.ndarray, order: np.ndarray, total: float) -> int | None: ...

    def _draw(self, logits: np.ndarray, order: np.ndarray, total: float | None = None) -> int | None:
        """Draw from the tokens in `order` (falling probability). `total`: the whole vocabulary's mass where
        `order` holds only the likeliest candidates; None then if they hold less than top_p of it."""
        p = self.params
        probs = np.exp(logits[order] - logits[order[0]]).astype(np.float64)  # the likeliest's is 1
        if p.min_p:
            keep = max(int(np.count_nonzero(probs >= p.min_p)), 1)
            order, probs = order[:keep], probs[:keep]
        probs /= probs.sum() if total is None else total
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)  # smallest prefix with mass >= top_p
            if keep > probs.size and total is not None:
                return None
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(len(order), p=probs)])

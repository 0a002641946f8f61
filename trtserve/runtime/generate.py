"""KV-cache decoding over any Backend that runs a decoder engine.

The engine takes per-layer past key/values and returns presents; this module threads them
through prefill and single-token steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trtserve.runtime.base import Backend

PAST_PREFIX = "past_key_values."
LOGIT_POSITIONS = "logit_positions"


def past_names(backend: Backend) -> list[str]:
    return [spec.name for spec in backend.inputs if spec.name.startswith(PAST_PREFIX)]


def present_name(past: str) -> str:
    return "present." + past[len(PAST_PREFIX):]


def logit_feed(backend: Backend, new_tokens: int, last_only: bool) -> dict[str, np.ndarray]:
    """The `logit_positions` feed: the last new position, or all of them. Empty for engines built
    before the input existed (they always return every position)."""
    if not any(spec.name == LOGIT_POSITIONS for spec in backend.inputs):
        return {}
    first = new_tokens - 1 if last_only else 0
    return {LOGIT_POSITIONS: np.arange(first, new_tokens, dtype=np.int64)}


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    """Left padding: each row counts its own positions from its first real token."""
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)


@dataclass
class DecodeState:
    mask: np.ndarray  # (B, T) 1 for real tokens, including every token fed so far
    past: dict[str, np.ndarray] = field(default_factory=dict)


def start(backend: Backend, batch: int) -> DecodeState:
    specs = {spec.name: spec for spec in backend.inputs}
    past = {}
    for name in past_names(backend):
        _, heads, _, dim = specs[name].shape  # (B, Hkv, P, D)
        assert isinstance(heads, int) and isinstance(dim, int)  # fixed axes
        past[name] = np.zeros((batch, heads, 0, dim), dtype=np.dtype(specs[name].dtype))
    return DecodeState(mask=np.zeros((batch, 0), dtype=np.int64), past=past)


def step(backend: Backend, state: DecodeState, input_ids: np.ndarray, mask: np.ndarray | None = None,
         last_only: bool = False) -> np.ndarray:
    """Feed (B, S) new tokens (mask (B, S), default all real); return (B, S, V) logits, or (B, 1, V)
    with `last_only` (the LM head then runs on the last position only)."""
    new_mask = np.ones_like(input_ids) if mask is None else mask.astype(np.int64)
    full_mask = np.concatenate([state.mask, new_mask], axis=1)
    positions = positions_from_mask(full_mask)[:, -input_ids.shape[1]:]
    feeds = {"input_ids": input_ids.astype(np.int64), "attention_mask": full_mask, "position_ids": positions,
             **logit_feed(backend, input_ids.shape[1], last_only)}
    feeds.update(state.past)
    out = backend.infer(feeds)
    state.mask = full_mask
    state.past = {name: out[present_name(name)] for name in state.past}
    return out["logits"]


def greedy(backend: Backend, input_ids: np.ndarray, mask: np.ndarray, steps: int, forced: np.ndarray | None = None):
    """Prefill, then `steps` single-token steps. Returns (tokens (B, steps), step logits (B, steps, V)).

    With `forced` (B, steps) the given tokens are fed instead of the argmax (teacher forcing),
    so logits of two backends can be compared step by step on the same path.
    """
    state = start(backend, input_ids.shape[0])
    logits = step(backend, state, input_ids, mask, last_only=True)[:, -1]
    tokens, all_logits = [], []
    for i in range(steps):
        all_logits.append(logits)
        choice = logits.argmax(-1) if forced is None else forced[:, i]
        tokens.append(choice)
        if i + 1 < steps:
            logits = step(backend, state, choice[:, None], last_only=True)[:, -1]
    return np.stack(tokens, 1), np.stack(all_logits, 1)

"""Continuous batching for decoder engines: sequences join the running batch between decode steps
and leave when finished. The running batch keeps one left-padded KV cache; it is re-packed only
when membership changes (newcomers merged in, finished rows cut out, all-padding columns trimmed).
Each step feeds the newcomers one chunk of their prompts (at most `max_prefill_tokens` padded tokens,
chunked prefill) and then decodes one token for every running sequence, so newcomers' prompts hold
the running streams back by one bounded chunk per step; newcomers join the batch after their last
chunk. Chunks feed the KV cache exactly as one call would (the same positions and mask)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from trtserve.runtime.base import Backend
from trtserve.runtime.events import Event, FinishReason, failed
from trtserve.runtime.generate import DecodeState, logit_feed, past_names, positions_from_mask, present_name
from trtserve.runtime.generate import step as feed_tokens
from trtserve.runtime.sampling import Sampler, SamplingError, SamplingParams, finish_reason, prompt_logprobs


@dataclass
class Sequence:
    id: str
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    next_token: int = -1  # fed at the next decode step
    generated: int = 0
    length: int = 0  # tokens in the KV cache

    @property
    def total(self) -> int:
        return len(self.prompt) + self.generated


@dataclass
class _Batch:
    seqs: list[Sequence] = field(default_factory=list)
    past: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (B, Hkv, P, D), left-padded
    mask: np.ndarray | None = None  # (B, P)


@dataclass
class _Prefill:
    """Newcomers being prefilled chunk by chunk: their left-padded prompts and the cache fed so far."""

    seqs: list[Sequence]
    ids: np.ndarray  # (B, L)
    mask: np.ndarray  # (B, L)
    state: DecodeState
    fed: int = 0  # columns fed
    logits: list = field(default_factory=list)  # every position's, when the prompt's logprobs are wanted

    def keep(self, rows: list[int]) -> None:
        self.seqs = [self.seqs[i] for i in rows]
        self.ids, self.mask = self.ids[rows], self.mask[rows]
        self.state.mask = self.state.mask[rows]
        self.state.past = {n: v[rows] for n, v in self.state.past.items()}


class ContinuousBatcher:
    def __init__(self, backend: Backend, eos_ids: set[int], max_num_seqs: int = 16,
                 max_batched_tokens: int = 4096, pad_id: int = 0, max_prefill_tokens: int | None = None):
        """`max_batched_tokens`: padded prompt tokens admitted into one prefill; `max_prefill_tokens`:
        padded tokens fed per step (a chunk: newcomers x columns; None: the whole prefill in one call)."""
        manifest = backend.engine.manifest
        assert manifest.shapes is not None and manifest.shapes.total_sequence is not None  # a decoder's
        self._setup(backend, eos_ids, min(max_num_seqs, manifest.shapes.batch.max), max_batched_tokens, pad_id,
                    max_prefill_tokens, manifest.shapes.total_sequence.max, manifest.model.architecture.vocab_size)
        self.names = past_names(backend)
        specs = {spec.name: spec for spec in backend.inputs}
        # (Hkv, D): fixed axes of the past inputs
        self.kv_shape = {n: cast("tuple[int, int]", (specs[n].shape[1], specs[n].shape[3])) for n in self.names}

    def _setup(self, backend: Backend, eos_ids: set[int], max_num_seqs: int, max_batched_tokens: int, pad_id: int,
               max_prefill_tokens: int | None, max_seq: int, vocab: int) -> None:
        """What every batcher holds: limits, the waiting queue and the batch."""
        self.backend, self.eos_ids, self.pad_id = backend, set(eos_ids), pad_id
        self.max_num_seqs, self.max_batched_tokens, self.max_prefill_tokens = (max_num_seqs, max_batched_tokens,
                                                                               max_prefill_tokens)
        self.max_seq, self.vocab = max_seq, vocab
        self.waiting: deque[Sequence] = deque()
        self.batch = _Batch()
        self.prefill: _Prefill | None = None
        self.newcomers: list[Sequence] = []  # being prefilled, not yet in the batch
        self.constraints = None  # grammar -> Constraint (runtime/constraints.py), where the worker set one

    # -- membership ---------------------------------------------------------------------------
    def add(self, seq_id: str, prompt: list[int], params: SamplingParams) -> None:
        constraint = None
        if params.grammar is not None:
            if self.constraints is None:
                raise SamplingError("this batcher cannot constrain decoding to a grammar")
            constraint = self.constraints(params.grammar)
        sampler = Sampler(params, self.vocab, constraint, prompt, self.eos_ids)
        self.waiting.append(Sequence(seq_id, list(prompt), params, sampler))

    def _unwait(self, seq_id: str) -> bool:
        """Take a sequence out of the waiting queue; whether it was there."""
        for seq in list(self.waiting):
            if seq.id == seq_id:
                self.waiting.remove(seq)
                return True
        return False

    def cancel(self, seq_id: str) -> bool:
        if self._unwait(seq_id):
            return True
        if self.prefill and any(s.id == seq_id for s in self.prefill.seqs):
            self.prefill.keep([i for i, s in enumerate(self.prefill.seqs) if s.id != seq_id])
            if not self.prefill.seqs:
                self.prefill = None
            self.newcomers = self.prefill.seqs if self.prefill else []
            return True
        rows = [i for i, s in enumerate(self.batch.seqs) if s.id == seq_id]
        self._drop(rows)
        return bool(rows)

    def has_work(self) -> bool:
        return bool(self.waiting or self.batch.seqs or self.prefill)

    def decoding(self) -> list[Sequence]:
        """The sequences whose prompts are in: each gets a token every step."""
        return self.batch.seqs

    @property
    def running(self) -> int:
        return len(self.decoding())

    @property
    def prefilling(self) -> int:
        """Sequences whose prompts are being fed in chunks (admitted, not yet in the batch)."""
        return len(self.prefill.seqs) if self.prefill else 0

    # -- one step -------------------------------------------------------------------------------
    def step(self, early=None) -> list[Event]:
        """One step: a prefill chunk for the newcomers, then a token for every running sequence. `early`, where
        given, is called with the chunk's events (first tokens) before the decode call, so they need not wait
        for it; the events returned are the rest."""
        events: list[Event] = []
        if self.prefill is None:
            newcomers = self._admit()
            if newcomers:
                self.prefill = self._start_prefill(newcomers)
        self.newcomers = self.prefill.seqs if self.prefill else []
        if self.prefill:
            events += self._prefill_chunk()
        if early is not None and events and self.batch.seqs:
            early(events)
            events = []
        if self.batch.seqs:
            events += self._decode()
        return events

    def _admit(self) -> list[Sequence]:
        """Newcomers for one prefill; a sequence that wants its prompt's logprobs is prefilled alone
        (its logits are needed at every position, the others' at the last only)."""
        room = self.max_num_seqs - self.running - self.prefilling
        chosen: list[Sequence] = []
        while self.waiting and len(chosen) < room:
            if self.waiting[0].params.prompt_logprobs is not None:
                if not chosen:
                    chosen.append(self.waiting.popleft())
                break
            longest = max([len(self.waiting[0].prompt)] + [len(s.prompt) for s in chosen])
            if chosen and (len(chosen) + 1) * longest > self.max_batched_tokens:
                break
            chosen.append(self.waiting.popleft())
        return chosen

    def _start_prefill(self, seqs: list[Sequence]) -> _Prefill:
        longest = max(len(s.prompt) for s in seqs)
        ids = np.full((len(seqs), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, s in enumerate(seqs):  # left padding: every row's last column is its last prompt token
            ids[i, longest - len(s.prompt):] = s.prompt
            mask[i, longest - len(s.prompt):] = 1
        past = {name: np.zeros((len(seqs), heads, 0, dim), dtype=np.float32)
                for name, (heads, dim) in self.kv_shape.items()}
        return _Prefill(list(seqs), ids, mask, DecodeState(np.zeros((len(seqs), 0), dtype=np.int64), past))

    def _prefill_chunk(self) -> list[Event]:
        """Feed the next chunk of the newcomers' prompts; after the last, merge them into the batch and
        choose their first tokens."""
        p = self.prefill
        assert p is not None
        rows, longest = p.ids.shape
        budget = self.max_prefill_tokens or rows * longest
        end = min(longest, p.fed + max(1, budget // rows))
        scored = p.seqs[0].params.prompt_logprobs if rows == 1 else None
        try:
            logits = feed_tokens(self.backend, p.state, p.ids[:, p.fed:end], p.mask[:, p.fed:end],
                                 last_only=scored is None)
        except Exception as exc:
            self.prefill = None
            return [failed(s.id, exc) for s in p.seqs]
        p.fed = end
        if scored is not None:
            p.logits.append(logits[0])
        if end < longest:
            return []
        self.prefill = None
        seqs = p.seqs
        for s in seqs:
            s.length = len(s.prompt)
        self.batch = _merge(self.batch, _Batch(list(seqs), p.state.past, p.state.mask))
        events = self._choose(seqs, logits[:, -1])
        if scored is not None:
            self._score_prompt(events, seqs[0], np.concatenate(p.logits), scored)
        return events

    def _score_prompt(self, events: list[Event], seq: Sequence, logits: np.ndarray, top: int) -> None:
        """Put the prompt's logprobs on the sequence's first event (events[0]); if they cannot be computed,
        that event becomes the error and the sequence ends (as for sampling: the rest go on)."""
        try:
            events[0].prompt_logprobs = prompt_logprobs(seq.prompt, logits, top)
        except Exception as exc:  # noqa: BLE001
            events[0] = failed(seq.id, exc)
            self._finish({seq.id})

    def _decode(self) -> list[Event]:
        b = self.batch
        full = np.concatenate([b.mask, np.ones((len(b.seqs), 1), dtype=np.int64)], axis=1)
        feeds = {"input_ids": np.array([[s.next_token] for s in b.seqs], dtype=np.int64), "attention_mask": full,
                 "position_ids": positions_from_mask(full)[:, -1:], **logit_feed(self.backend, 1, True), **b.past}
        seqs = list(b.seqs)
        try:
            out = self.backend.infer(feeds)
        except Exception as exc:
            self._drop(list(range(len(seqs))))
            return [failed(s.id, exc) for s in seqs]
        b.past, b.mask = {n: out[present_name(n)] for n in self.names}, full
        for s in seqs:
            s.length += 1
        return self._choose(seqs, out["logits"][:, -1])

    def _choose(self, seqs: list[Sequence], logits: np.ndarray) -> list[Event]:
        events, done = [], []
        for row, s in enumerate(seqs):
            try:
                token, logprob, top = s.sampler.choose(logits[row])
            except Exception as exc:  # this sequence ends with the error; its neighbours go on
                events.append(failed(s.id, exc))
                done.append(s.id)
                continue
            finish = finish_reason(token, s.params, self.eos_ids, s.generated + 1, s.total + 1, self.max_seq)
            if finish is FinishReason.STOP:
                events.append(Event(s.id, -1, logprob, top, finish=finish))
                done.append(s.id)
                continue
            s.generated += 1
            s.next_token = token
            events.append(Event(s.id, token, logprob, top, finish=finish))
            if finish:
                done.append(s.id)
        if done:
            self._finish(set(done))
        return events

    def _finish(self, ids: set[str]) -> None:
        self._drop([i for i, s in enumerate(self.batch.seqs) if s.id in ids])

    def held(self) -> list[Sequence]:
        """Every sequence the batcher holds: waiting, being prefilled, running."""
        return list(self.waiting) + self.newcomers + self.batch.seqs

    def _drop(self, rows: list[int]) -> None:
        """Cut rows out of the running batch and trim the columns that are padding for every row left."""
        if not rows:
            return
        b = self.batch
        gone = set(rows)
        keep = [i for i in range(len(b.seqs)) if i not in gone]
        b.seqs = [b.seqs[i] for i in keep]
        if not keep:
            self.batch = _Batch()
            return
        assert b.mask is not None
        b.mask = b.mask[keep]
        first = int(np.argmax(b.mask.any(axis=0)))
        b.mask = b.mask[:, first:]
        b.past = {n: np.ascontiguousarray(v[keep][:, :, first:]) for n, v in b.past.items()}


def _merge(a: _Batch, b: _Batch) -> _Batch:
    """One batch from two, left-padding the shorter cache."""
    if not a.seqs:
        return b
    assert a.mask is not None and b.mask is not None
    width = max(a.mask.shape[1], b.mask.shape[1])

    def pad(batch: _Batch) -> tuple[np.ndarray, dict]:
        assert batch.mask is not None
        extra = width - batch.mask.shape[1]
        mask = np.pad(batch.mask, ((0, 0), (extra, 0)))
        past = {n: np.pad(v, ((0, 0), (0, 0), (extra, 0), (0, 0))) for n, v in batch.past.items()}
        return mask, past

    (ma, pa), (mb, pb) = pad(a), pad(b)
    return _Batch(a.seqs + b.seqs, {n: np.concatenate([pa[n], pb[n]]) for n in pa}, np.concatenate([ma, mb]))

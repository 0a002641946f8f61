"""Continuous batching over sequence slots (runtime.kv_slots): each sequence owns one slot of the KV
buffers and its cache grows in place. Slots [0, d) hold the sequences being decoded and [d, n) the
newcomers being prefilled, so every call covers only rows that have work. Newcomers are admitted every
step as slots free up, and each step feeds them one chunk (at most `max_prefill_tokens` padded tokens),
first come first served: the oldest newcomer gets up to the whole budget and the next ones join at its
width while the padded total stays within it, so a prompt's first token waits for the prompts before
it, not for a whole wave of them. One call then decodes a token for each of [0, d). A newcomer whose
prompt is in swaps into slot d and joins that decode call; a sequence that ends gives its slot to the
last decoding one, whose slot goes to the last newcomer (at most two sequences' rows copied, nobody
else's). Scheduling of the waiting queue, sampling and finish rules are the ContinuousBatcher's."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from trtserve.runtime.base import Backend, BackendLost
from trtserve.runtime.batching import ContinuousBatcher, Sequence
from trtserve.runtime.events import Event, failed

if TYPE_CHECKING:  # a protocol for the checker only
    from trtserve.runtime.base import SlotBackend


def make_batcher(backend: Backend, eos_ids: set[int], max_num_seqs: int = 16, max_batched_tokens: int = 4096,
                 pad_id: int = 0, max_prefill_tokens: int | None = None) -> ContinuousBatcher:
    """The slot batcher where the backend has sequence slots (a decode graph, a track engine's ranks), else
    the padded one."""
    if backend.abilities.kv_slots:
        return SlotBatcher(cast("SlotBackend", backend), eos_ids, max_num_seqs, max_batched_tokens, pad_id,
                           max_prefill_tokens)
    return ContinuousBatcher(backend, eos_ids, max_num_seqs, max_batched_tokens, pad_id, max_prefill_tokens)


class SlotBatcher(ContinuousBatcher):
    def __init__(self, backend: SlotBackend, eos_ids: set[int], max_num_seqs: int = 16, max_batched_tokens: int = 4096,
                 pad_id: int = 0, max_prefill_tokens: int | None = None):
        self.slots = backend.kv_slots(max_num_seqs)  # at most that many: the backend knows its engine's limits
        self._setup(backend, eos_ids, self.slots.slots, max_batched_tokens, pad_id, max_prefill_tokens,
                    self.slots.capacity, self.slots.vocab)
        self.table: list[Sequence] = []  # slot -> its sequence; no holes
        self.d = 0  # slots [0, d) decode, [d, len(table)) are being prefilled
        self.scored: list[np.ndarray] = []  # prompt logits so far of a sequence that asked for them
        self.scored_id: str | None = None  # whose they are (a cancelled sequence leaves its own behind)
        self.prefix_cache = None  # runtime/prefix_cache.PrefixCache, where the worker set one

    def decoding(self) -> list[Sequence]:
        return self.table[:self.d]

    @property
    def prefilling(self) -> int:
        return len(self.table) - self.d

    def has_work(self) -> bool:
        return bool(self.waiting or self.table)

    def held(self) -> list[Sequence]:
        return list(self.waiting) + self.table

    def cancel(self, seq_id: str) -> bool:
        if self._unwait(seq_id):
            return True
        rows = [i for i, s in enumerate(self.table) if s.id == seq_id]
        self._drop(rows)
        self.newcomers = [s for s in self.newcomers if s.id != seq_id]
        return bool(rows)

    def step(self, early=None) -> list[Event]:
        """One step: a prefill chunk for the newcomers, then a token for every decoding sequence. `early`, where
        given, is called with the chunk's events (first tokens) before the decode call, so they need not wait
        for it; the events returned are the rest."""
        for seq in self._admit():  # every step, as slots free up: a newcomer waits for no other's prefill
            seq.length = 0
            self.slots.clear(len(self.table))
            if self.prefix_cache is not None and seq.params.prompt_logprobs is None:
                seq.length = self.prefix_cache.load(self.slots, len(self.table), seq.prompt)
            self.table.append(seq)
        self.newcomers = self.table[self.d:]
        events = self._prefill_chunk() if self.newcomers else []
        if early is not None and events and self.d:
            early(events)
            events = []
        return events + (self._decode_rows() if self.d else [])

    def _chunk(self, left: list[int]) -> tuple[int, int]:
        """(rows, width) of this step's prefill call over the first newcomers, first come first served: the
        oldest gets up to the whole budget, and the next ones join while rows x width stays within it. A
        sequence that wants its prompt's logprobs is fed alone."""
        seqs = self.table[self.d:]
        if seqs[0].params.prompt_logprobs is not None:
            return 1, min(left[0], self.max_prefill_tokens or left[0])
        if not self.max_prefill_tokens:  # the whole prefill of every newcomer in one call
            rows = next((i for i, s in enumerate(seqs) if s.params.prompt_logprobs is not None), len(seqs))
            return rows, max(left[:rows])
        width = min(left[0], self.max_prefill_tokens)
        rows = 1
        while rows < len(seqs) and seqs[rows].params.prompt_logprobs is None \
                and (rows + 1) * width <= self.max_prefill_tokens:
            rows += 1
        return rows, width

    def _call(self, first: int, ids: np.ndarray, counts: np.ndarray, index: np.ndarray, seqs: list[Sequence]):
        """One call over slots [first, first + len(ids)); on failure its sequences end with the error."""
        try:
            return self.slots.run(first, ids, counts, index), []
        except BackendLost:  # every sequence is gone, not only this call's: the worker starts afresh
            raise
        except Exception as exc:  # noqa: BLE001 - the call's sequences end, the batcher goes on
            ids_gone = {s.id for s in seqs}
            self._drop([i for i, s in enumerate(self.table) if s.id in ids_gone])
            return None, [failed(s.id, exc) for s in seqs]

    def _prefill_chunk(self) -> list[Event]:
        first = self.d
        left = [len(s.prompt) - s.length for s in self.table[first:]]
        rows, width = self._chunk(left)
        seqs = self.table[first:first + rows]
        ids = np.full((rows, width), self.pad_id, dtype=np.int64)
        counts = np.minimum(width, left[:rows])
        for row, s in enumerate(seqs):
            ids[row, :counts[row]] = s.prompt[s.length:s.length + counts[row]]
        scored = seqs[0].params.prompt_logprobs
        if scored is not None and self.scored_id != seqs[0].id:  # its first chunk
            self.scored, self.scored_id = [], seqs[0].id
        last = (counts - 1)[:, None]
        index = np.minimum(np.arange(width)[None, :], last) if scored is not None else last
        logits, events = self._call(first, ids, counts, index, seqs)
        if logits is None:
            return events
        done = []
        for row, s in enumerate(seqs):
            s.length += int(counts[row])
            if scored is not None:
                self.scored.append(logits[row, :counts[row]])
            if s.length == len(s.prompt):
                done.append((s, logits[row, -1]))
                if self.prefix_cache is not None:
                    self.prefix_cache.store(self.slots, self.table.index(s), s.prompt)
                self._swap(self.table.index(s), self.d)  # into the decoding slots
                self.d += 1
        if not done:
            return []
        events = self._choose([s for s, _ in done], np.stack([row for _, row in done]))
        if scored is not None:
            self._score_prompt(events, done[0][0], np.concatenate(self.scored), scored)
            self.scored, self.scored_id = [], None
        return events

    def _decode_rows(self) -> list[Event]:
        seqs = self.table[:self.d]
        ids = np.array([[s.next_token] for s in seqs], dtype=np.int64)
        logits, events = self._call(0, ids, np.ones(len(seqs), np.int64), np.zeros((len(seqs), 1), np.int64), seqs)
        if logits is None:
            return events
        for s in seqs:
            s.length += 1
        return self._choose(seqs, logits[:, 0])

    def _finish(self, ids: set[str]) -> None:
        self._drop([i for i, s in enumerate(self.table) if s.id in ids])

    def _move(self, source: int, target: int) -> None:
        if source != target:
            self.slots.move(source, target)
            self.table[target] = self.table[source]

    def _swap(self, a: int, b: int) -> None:
        if a != b:
            self.slots.swap(a, b)
            self.table[a], self.table[b] = self.table[b], self.table[a]

    def _drop(self, rows: list[int]) -> None:
        """Free slots, keeping [0, d) decoding and [d, n) prefilling with no holes: a decoding slot gets the
        last decoding sequence, whose slot gets the last newcomer; a newcomer's slot gets the last newcomer."""
        for row in sorted(set(rows), reverse=True):
            last = len(self.table) - 1
            if row < self.d:
                self._move(self.d - 1, row)
                self._move(last, self.d - 1)
                self.d -= 1
            else:
                self._move(last, row)
            self.slots.clear(last)
            self.table.pop()

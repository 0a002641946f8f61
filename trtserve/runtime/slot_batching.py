"""Continuous batching over sequence slots (runtime.kv_slots): each sequence owns one slot of the KV
buffers from admission to its end, and its cache grows in place. Running sequences hold slots
[0, n) with no holes: when one ends, the sequence in the last slot moves into its slot (one sequence's
rows copied, nobody else's). Newcomers take the next slots; each step feeds them one chunk of their
prompts (at most `max_prefill_tokens` padded tokens across them, right-padded) and then decodes one
token for every sequence whose prompt is in, so a newcomer joins the decode steps as soon as its own
prompt is fed. Scheduling, sampling and finish rules are the ContinuousBatcher's."""

from __future__ import annotations

import numpy as np

from trtserve.runtime.base import Backend
from trtserve.runtime.batching import ContinuousBatcher, Event, Sequence
from trtserve.runtime.sampling import prompt_logprobs


def make_batcher(backend: Backend, eos_ids: set[int], max_num_seqs: int = 16, max_batched_tokens: int = 4096,
                 pad_id: int = 0, max_prefill_tokens: int | None = None) -> ContinuousBatcher:
    """The slot batcher where the engine has a decode graph for this backend, else the padded one."""
    slots = getattr(backend, "kv_slots", None)
    if slots is not None and getattr(backend, "kv_graph", None):
        return SlotBatcher(backend, eos_ids, max_num_seqs, max_batched_tokens, pad_id, max_prefill_tokens)
    return ContinuousBatcher(backend, eos_ids, max_num_seqs, max_batched_tokens, pad_id, max_prefill_tokens)


class SlotBatcher(ContinuousBatcher):
    def __init__(self, backend: Backend, eos_ids: set[int], max_num_seqs: int = 16, max_batched_tokens: int = 4096,
                 pad_id: int = 0, max_prefill_tokens: int | None = None):
        super().__init__(backend, eos_ids, max_num_seqs, max_batched_tokens, pad_id, max_prefill_tokens)
        self.slots = backend.kv_slots(self.max_num_seqs)
        self.max_seq = min(self.max_seq, self.slots.capacity)
        self.table: list[Sequence] = []  # slot -> its sequence; no holes
        self.scored: list[np.ndarray] = []  # prompt logits so far of a sequence that asked for them

    def decoding(self) -> list[Sequence]:
        return [s for s in self.table if s.length >= len(s.prompt)]

    @property
    def prefilling(self) -> int:
        return len(self.table) - self.running

    def has_work(self) -> bool:
        return bool(self.waiting or self.table)

    def held(self) -> list[Sequence]:
        return list(self.waiting) + self.table

    def cancel(self, seq_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.id == seq_id:
                self.waiting.remove(seq)
                return True
        rows = [i for i, s in enumerate(self.table) if s.id == seq_id]
        self._drop(rows)
        self.newcomers = [s for s in self.newcomers if s.id != seq_id]
        return bool(rows)

    def step(self) -> list[Event]:
        if not self.prefilling:
            for seq in self._admit():
                seq.length = 0
                self.slots.clear(len(self.table))
                self.table.append(seq)
        self.newcomers = [s for s in self.table if s.length < len(s.prompt)]
        events = self._prefill_chunk() if self.newcomers else []
        ready = [i for i, s in enumerate(self.table) if s.length >= len(s.prompt) and s.generated]
        return events + (self._decode_rows(ready) if ready else [])

    def _call(self, first: int, ids: np.ndarray, counts: np.ndarray, index: np.ndarray, seqs: list[Sequence]):
        """One call over slots [first, first + len(ids)); on failure its sequences end with the error."""
        try:
            return self.slots.run(first, ids, counts, index), []
        except Exception as exc:  # noqa: BLE001 - the call's sequences end, the batcher goes on
            ids_gone = {s.id for s in seqs}
            self._drop([i for i, s in enumerate(self.table) if s.id in ids_gone])
            return None, [Event(s.id, -1, error=f"{type(exc).__name__}: {exc}") for s in seqs]

    def _prefill_chunk(self) -> list[Event]:
        rows = [i for i, s in enumerate(self.table) if s.length < len(s.prompt)]
        first, last = rows[0], rows[-1] + 1
        left = {i: len(self.table[i].prompt) - self.table[i].length for i in rows}
        budget = self.max_prefill_tokens or len(rows) * max(left.values())
        width = min(max(left.values()), max(1, budget // len(rows)))
        ids = np.full((last - first, width), self.pad_id, dtype=np.int64)
        counts = np.zeros(last - first, dtype=np.int64)
        for i in rows:
            s = self.table[i]
            counts[i - first] = min(width, left[i])
            ids[i - first, :counts[i - first]] = s.prompt[s.length:s.length + counts[i - first]]
        scored = self.table[rows[0]].params.prompt_logprobs if len(rows) == 1 else None
        index = (np.arange(width)[None, :].repeat(last - first, 0) if scored is not None
                 else np.maximum(counts - 1, 0)[:, None])
        seqs = [self.table[i] for i in rows]
        logits, events = self._call(first, ids, counts, np.minimum(index, np.maximum(counts - 1, 0)[:, None]), seqs)
        if logits is None:
            self.scored = []
            return events
        done = []
        for i in rows:
            s = self.table[i]
            s.length += int(counts[i - first])
            if scored is not None:
                self.scored.append(logits[i - first, :counts[i - first]])
            if s.length == len(s.prompt):
                done.append((s, logits[i - first, counts[i - first] - 1 if scored is not None else 0]))
        if not done:
            return []
        events = self._choose([s for s, _ in done], np.stack([row for _, row in done]))
        if scored is not None:
            seq = done[0][0]
            try:
                events[0].prompt_logprobs = prompt_logprobs(seq.prompt, np.concatenate(self.scored), scored)
            except Exception as exc:  # noqa: BLE001 - as for sampling: this sequence ends, the rest go on
                events[0] = Event(seq.id, -1, error=f"{type(exc).__name__}: {exc}")
                self._drop([i for i, s in enumerate(self.table) if s.id == seq.id])
            self.scored = []
        return events

    def _decode_rows(self, rows: list[int]) -> list[Event]:
        last = rows[-1] + 1
        ids = np.full((last, 1), self.pad_id, dtype=np.int64)
        counts = np.zeros(last, dtype=np.int64)
        for i in rows:
            ids[i, 0], counts[i] = self.table[i].next_token, 1
        seqs = [self.table[i] for i in rows]
        logits, events = self._call(0, ids, counts, np.zeros((last, 1), np.int64), seqs)
        if logits is None:
            return events
        for s in seqs:
            s.length += 1
        return self._choose(seqs, logits[rows, 0])

    def _finish(self, ids: set[str]) -> None:
        self._drop([i for i, s in enumerate(self.table) if s.id in ids])

    def _drop(self, rows: list[int]) -> None:
        """Free slots: the sequence in the last slot moves into each freed one."""
        for row in sorted(set(rows), reverse=True):
            last = len(self.table) - 1
            if row != last:
                self.slots.move(last, row)
                self.table[row] = self.table[last]
            self.slots.clear(last)
            self.table.pop()

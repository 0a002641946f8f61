"""A track-sharded engine dir (engine_builder/sharding.py) as a Backend that the slot batcher drives
(runtime/slot_batching.py), so its sequences get continuous batching, grammars and the prefix cache like any
decoder's.

Its ranks (runtime/sharded.py: processes that each run a share of the tracks and all-reduce at segment
boundaries) keep one KV cache per key; a sequence slot here names the key of its sequence, so moving or
swapping slots moves no rows, and a cleared slot's cache is dropped with the next call. The segment graphs
take no attention mask: a call batches the rows that hold the same number of tokens and feed the same
number, and runs one batch per such group. Token ids are the tokenizer's on both sides: prompts are mapped
into the model's compact vocabulary here and logits scattered back, so tokens outside it (and its
unknown id) are never chosen. A rank that dies, stops beating or misses a call's deadline fails the call
with BackendLost; the ranks are started afresh for the next batcher."""

from __future__ import annotations

import itertools
import json
import threading

import numpy as np

from trtserve.errors import InputError, TrtServeError
from trtserve.runtime.base import Abilities, BackendLost
from trtserve.runtime.kv_slots import checked_lengths
from trtserve.runtime.sharded import ReadSlot, ResetSlots, RunSlots, ShardedDecoder, WriteSlot


class TrackBackend:
    name = "onnxruntime"
    inputs = outputs = ()
    abilities = Abilities(kv_slots=True, processes=True)

    def __init__(self, engine, tracks: int | None = None, threads: int | None = None, timeout: float = 300.0,
                 heartbeat: float | None = None, start_timeout: float = 300.0):
        """`tracks`: rank processes sharing the engine's tracks (default: one per track); `threads`: CPU threads
        per rank; `timeout`: seconds a call may take; `heartbeat`: seconds a rank may go without a beat."""
        from trtserve.runtime.sharded import check_track_split
        from trtserve.runtime.text import load_tokenizer

        pt = engine.manifest.parallel_tracks
        self.engine, self.world = engine, tracks or pt.tracks
        check_track_split(pt.tracks, self.world)
        self.options = {"threads": threads or 1, "timeout": timeout, "start_timeout": start_timeout,
                        "heartbeat": heartbeat}
        compact = np.array(json.loads(engine.file("vocab.json").read_text()), dtype=np.int64)
        self.vocab = load_tokenizer(engine.path).get_vocab_size()
        self.known = compact >= 0  # compact ids with a tokenizer id (not the unknown id)
        self.known_ids = compact[self.known]
        self.to_compact = np.zeros(max(self.vocab, int(compact.max()) + 1), np.int64)  # outside: the unknown id 0
        self.to_compact[self.known_ids] = np.flatnonzero(self.known)
        self.names = [f"{t}:{name.removeprefix('past_')}" for t, graphs in enumerate(pt.segment_graphs)
                      for graph in graphs for name in pt.graphs[graph].inputs[1:]]
        self.decoder: ShardedDecoder | None = None
        self.keys = itertools.count()  # cache keys, never reused while the ranks live
        self._starting = threading.Lock()  # one start of the ranks at a time (an in-process loop and its successor)

    @property
    def processes(self) -> list[int]:
        return list(self.decoder.pids) if self.decoder is not None else []

    def ranks(self):
        """The running ranks: started on first use, and afresh when one of them has gone."""
        from trtserve.runtime.sharded import EngineShards, ShardedDecoder

        with self._starting:
            if self.decoder is not None and all(p.is_alive() for p in self.decoder.procs):
                return self.decoder
            if self.decoder is not None:
                self.decoder.kill()
            self.decoder = None
            self.decoder = ShardedDecoder(EngineShards(str(self.engine.path)), self.world, **self.options)
            return self.decoder

    def kv_slots(self, slots: int) -> TrackSlots:
        """Slots for a new batcher: the ranks' caches of any batcher before are dropped."""
        kv = TrackSlots(self, self.ranks(), slots)
        kv._call(ResetSlots())
        return kv

    def infer(self, feeds):
        raise InputError("a track-sharded engine runs sequences through its slots (kv_slots), not whole batches")

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()
            self.decoder = None


class TrackSlots:
    """Sequence slots over the ranks of one TrackBackend: the interface of runtime.kv_slots.KVSlots."""

    def __init__(self, backend: TrackBackend, decoder: ShardedDecoder, slots: int):
        self.backend, self.decoder, self.slots = backend, decoder, slots
        self.capacity = backend.engine.manifest.model.architecture.max_positions
        self.vocab, self.names = backend.vocab, backend.names
        self.length = np.zeros(slots, np.int64)
        self.keys = [next(backend.keys) for _ in range(slots)]  # slot -> the key of its cache in the ranks
        self._drops: list[int] = []  # caches to drop with the next call

    def _call(self, message) -> list:
        if self.decoder is not self.backend.decoder:
            raise BackendLost("the track workers were restarted; this sequence's cache is gone")
        try:
            return self.decoder.call(message)
        except TrtServeError as exc:
            raise BackendLost(f"the track workers failed: {exc}") from None

    def run(self, first: int, ids: np.ndarray, counts: np.ndarray, logit_index: np.ndarray) -> np.ndarray:
        """As KVSlots.run: logits (B, K, V) over the tokenizer's ids, -inf where the model has no token."""
        rows = ids.shape[0]
        before, after = checked_lengths(self, first, counts)
        every = logit_index.shape[1] > 1
        out = np.full((rows, logit_index.shape[1], self.vocab), -np.inf, np.float32)
        groups: dict[tuple[int, int], list[int]] = {}
        for row in np.flatnonzero(counts):  # rows that can share a call: same cached and new token counts
            groups.setdefault((int(before[row]), int(counts[row])), []).append(int(row))
        for (_, n), members in groups.items():
            keys = [self.keys[first + r] for r in members]
            compact = self.backend.to_compact[ids[members, :n]]
            drops, self._drops = self._drops, []
            logits = self._call(RunSlots(drops, keys, compact, every))[0]  # rank 0's
            for i, r in enumerate(members):
                chosen = logits[i][np.minimum(logit_index[r], n - 1)] if every else logits[i][None]
                out[r][:, self.backend.known_ids] = chosen[:, self.backend.known]
        self.length[first:first + rows] = after
        return out

    def clear(self, slot: int) -> None:
        """Give `slot` a new, empty cache; its old one is dropped with the next call."""
        if self.length[slot]:
            self._drops.append(self.keys[slot])
        self.keys[slot] = next(self.backend.keys)
        self.length[slot] = 0

    def move(self, source: int, target: int) -> None:
        if source == target:
            return
        self.clear(target)
        self.keys[target], self.length[target] = self.keys[source], self.length[source]
        self.length[source] = 0  # its key now belongs to `target`: not dropped
        self.keys[source] = next(self.backend.keys)

    def swap(self, a: int, b: int) -> None:
        self.keys[a], self.keys[b] = self.keys[b], self.keys[a]
        self.length[[a, b]] = self.length[[b, a]]

    def read(self, slot: int, start: int, stop: int) -> dict[str, np.ndarray]:
        if not 0 <= start <= stop <= self.length[slot]:
            raise InputError(f"rows {start}..{stop} are not all cached in slot {slot} ({self.length[slot]} are)")
        rows: dict[str, np.ndarray] = {}
        for part in self._call(ReadSlot(self.keys[slot], start, stop)):
            rows.update(part)
        return rows

    def write(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        n = next(iter(rows.values())).shape[1]
        if n > self.capacity:
            raise InputError(f"{n} rows do not fit the context of {self.capacity}")
        self.clear(slot)
        self._call(WriteSlot(self.keys[slot], rows))
        self.length[slot] = n

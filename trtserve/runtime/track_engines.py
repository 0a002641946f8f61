"""One worker's share of a track-sharded engine dir: ONNX Runtime sessions for its tracks' segments,
their KV cache, and the replicated embedding and head. The all-reduce is passed in, so the same
code runs all tracks in one process (reduce = identity) or a few tracks per worker."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class TrackEngines:
    def __init__(self, directory: Path, manifest, tracks, threads: int | None = 1):
        """`manifest`: the engine's (typed, or the dict a build is composing)."""
        import onnxruntime as ort

        from trtserve.engine_dir import as_manifest

        manifest = as_manifest(manifest)
        pt = manifest.parallel_tracks
        self.tracks = list(tracks)
        self.segments = pt.segments
        self.kv_heads = pt.kv_heads_per_track
        self.head_dim = manifest.model.architecture.head_dim
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1

        def session(name):
            graph = pt.graphs[name].graph
            return ort.InferenceSession(str(Path(directory) / graph), options, providers=["CPUExecutionProvider"])

        self.embed, self.head = session(pt.embed), session(pt.head)
        self.sessions = {(t, j): session(pt.segment_graphs[t][j]) for t in self.tracks for j in range(self.segments)}
        # per segment graph: its past inputs and present outputs, as cache keys ("key.3", "value.3")
        self.io = {k: ([i.name for i in s.get_inputs()][1:], [o.name for o in s.get_outputs()][1:])
                   for k, s in self.sessions.items()}
        self.caches: dict = {}  # key -> {(track, "key.3"): (rows, Hkv, P, D)}: one per sequence slot, or None's
        self.syncs = 0

    def forward(self, ids, reduce, new: bool = True, every_position: bool = False) -> np.ndarray:
        """Logits of the last position ([B, V]; of every position, [B, T, V], with `every_position`) of one
        batch of sequences with one cache; `new` starts fresh sequences (the cache is dropped)."""
        if new:
            self.caches.pop(None, None)
        return self.run([None], ids, reduce, every_position)

    def run(self, keys: list, ids, reduce, every_position: bool = False) -> np.ndarray:
        """As `forward`, for the caches named by `keys`, one row each (a single key: every row), that hold the
        same number of tokens: they are run as one batch and each keeps its rows of the presents. A key not
        seen before starts empty."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        batch = ids.shape[0]
        caches = [self.caches.setdefault(key, {}) for key in keys]
        h = self.embed.run(None, {"input_ids": ids})[0]
        empty = np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32)
        for j in range(self.segments):
            total = None
            for t in self.tracks:
                pasts, presents = self.io[(t, j)]
                feeds = {"hidden": h, **{name: self._joined(caches, (t, name.removeprefix("past_")), empty)
                                         for name in pasts}}
                outs = self.sessions[(t, j)].run(None, feeds)
                for name, value in zip(presents, outs[1:]):
                    entry = (t, name.removeprefix("present_"))
                    for row, cache in enumerate(caches):
                        cache[entry] = value if len(caches) == 1 else value[row:row + 1]
                total = outs[0] if total is None else total + outs[0]
            h = h + reduce(total)
            self.syncs += 1
        if every_position:
            return self.head.run(None, {"hidden": np.ascontiguousarray(h.reshape(-1, h.shape[-1]))})[0].reshape(
                *h.shape[:2], -1)
        return self.head.run(None, {"hidden": np.ascontiguousarray(h[:, -1])})[0]

    @staticmethod
    def _joined(caches: list[dict], entry: tuple, empty: np.ndarray) -> np.ndarray:
        parts = [cache[entry] for cache in caches if entry in cache]
        if not parts:
            return empty
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def drop(self, keys) -> None:
        for key in keys:
            self.caches.pop(key, None)

    def read(self, key, start: int, stop: int) -> dict[str, np.ndarray]:
        """A copy of one sequence's cached rows [start, stop): "track:key.3" -> (Hkv, stop - start, D)."""
        return {f"{t}:{name}": value[0, :, start:stop].copy() for (t, name), value in self.caches[key].items()}

    def write(self, key, rows: dict[str, np.ndarray]) -> None:
        """Make `rows` (as `read` gives them, this worker's tracks only) the cache of `key`."""
        self.caches[key] = {(int(t), name): value[None] for entry, value in rows.items()
                            for t, name in [entry.split(":", 1)] if int(t) in self.tracks}

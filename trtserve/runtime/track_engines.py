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
        self.cache: dict = {}
        self.syncs = 0

    def forward(self, ids, reduce, new: bool = True, every_position: bool = False) -> np.ndarray:
        """Logits of the last position ([B, V]; of every position, [B, T, V], with `every_position`); `new`
        starts fresh sequences (the cache is dropped)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if new:
            self.cache = {}
        batch = ids.shape[0]
        h = self.embed.run(None, {"input_ids": ids})[0]
        empty = np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32)
        for j in range(self.segments):
            total = None
            for t in self.tracks:
                pasts, presents = self.io[(t, j)]
                feeds = {"hidden": h, **{name: self.cache.get((t, name.removeprefix("past_")), empty)
                                         for name in pasts}}
                outs = self.sessions[(t, j)].run(None, feeds)
                for name, value in zip(presents, outs[1:]):
                    self.cache[(t, name.removeprefix("present_"))] = value
                total = outs[0] if total is None else total + outs[0]
            h = h + reduce(total)
            self.syncs += 1
        if every_position:
            return self.head.run(None, {"hidden": np.ascontiguousarray(h.reshape(-1, h.shape[-1]))})[0].reshape(
                *h.shape[:2], -1)
        return self.head.run(None, {"hidden": np.ascontiguousarray(h[:, -1])})[0]

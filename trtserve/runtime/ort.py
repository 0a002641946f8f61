"""ONNX Runtime backend: the embedded CPU default."""

from __future__ import annotations

import logging
import platform
from collections.abc import Mapping

import numpy as np

from trtserve.engine_dir import EngineDir
from trtserve.runtime.base import Abilities, available_cores, check_feeds, io_specs
from trtserve.runtime.kv_slots import kv_graph_of

log = logging.getLogger(__name__)


class OrtBackend:
    name = "onnxruntime"

    def __init__(self, engine: EngineDir, threads: int | None = None, graph=None, arena: bool = True):
        """`graph` overrides the engine's graph (used to run a fidelity emulation graph). `arena=False`: every
        activation freed after its run (a measurement over many shapes, whose arena would grow to hold each
        shape's buffers, never returned, where a server's shapes repeat)."""
        import onnxruntime as ort

        self.engine = engine
        self.inputs, self.outputs = io_specs(engine.manifest)
        self.ranges = engine.manifest.shapes
        entry = engine.manifest.backend
        graph_override = graph is not None
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or available_cores()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        options.enable_cpu_mem_arena = arena
        same_build = entry is not None and (entry.onnxruntime_version, entry.machine) == (ort.__version__,
                                                                                          platform.machine())
        if graph is not None:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        elif same_build and entry is not None and entry.name == "onnxruntime":
            # Already optimized at build time by this ORT version: skip the work at load.
            graph = engine.file(entry.graph)
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        else:
            # ORT's offline-optimized graphs are tied to the version and CPU that wrote them; the
            # portable graph is optimized at load instead.
            log.warning(
                "engine %s was optimized by onnxruntime %s on %s, this is %s on %s: optimizing the portable "
                "graph at load (rebuild with `%s` to skip this)",
                engine.path, entry and entry.onnxruntime_version, entry and entry.machine, ort.__version__,
                platform.machine(), engine.rebuild,
            )
            assert engine.manifest.onnx is not None
            graph = engine.file(engine.manifest.onnx.file)
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.threads = options.intra_op_num_threads
        self._load = lambda: ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self._session = self._kv_session = None
        self._output_names = [spec.name for spec in self.outputs]
        self.kv_graph = None if graph_override else kv_graph_of(engine)
        self.abilities = Abilities(kv_slots=self.kv_graph is not None)

    @property
    def session(self):
        """Loaded on first use: a server that decodes through the kv graph never holds this one's weights."""
        if self._session is None:
            self._session = self._load()
        return self._session

    def kv_slots(self, slots: int):
        """Sequence slots over the engine's decode graph (runtime.kv_slots), or None without one."""
        from trtserve.runtime.kv_slots import KVSlots

        if not self.kv_graph:
            return None
        assert self.engine.manifest.shapes is not None
        kv = KVSlots(self.engine, min(slots, self.engine.manifest.shapes.batch.max), self.threads,
                     session=self._kv_session)
        self._kv_session = kv.session  # loaded once; each batcher gets buffers of its own
        return kv

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(feeds, self.inputs, self.ranges)
        values = self.session.run(self._output_names, dict(feeds))
        return dict(zip(self._output_names, values))

    def close(self) -> None:
        self._session = self._kv_session = None

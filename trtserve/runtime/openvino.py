"""OpenVINO backend: an encoder's or cross-encoder's portable graph compiled by OpenVINO for the CPU, in the
inference precision its build measured at the gate (the engine's `openvino` part)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np

from trtserve.engine_dir import EngineDir
from trtserve.engine_dir.kinds import ModelKind
from trtserve.errors import TrtServeError
from trtserve.runtime.base import Abilities, available_cores, check_feeds, io_specs

# decoders: measured slower than ONNX Runtime (docs/benchmarks.md, OpenVINO)
KINDS = (ModelKind.ENCODER, ModelKind.SCORER)
PRECISIONS = ("bf16", "f32")


def import_openvino():
    """The openvino module, or TrtServeError saying how to install it."""
    try:
        import openvino
    except ImportError as e:
        raise TrtServeError(f"the openvino package is not installed ({e}): pip install 'trtserve[openvino]'") from e
    return openvino


def cpu_precisions(core) -> tuple[str, ...]:
    """The inference precisions OpenVINO's CPU plugin computes in natively on this machine (bf16 needs
    avx512_bf16 or AMX; without them OpenVINO would compute f32 whatever it is told)."""
    capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return tuple(p for p in PRECISIONS if p == "f32" or p.upper() in capabilities)


def installed() -> bool:
    """Whether the openvino package is importable here (without importing it)."""
    from importlib.util import find_spec

    return find_spec("openvino") is not None


def unservable(entry) -> str | None:
    """Why an engine's kept OpenVINO precision cannot run here (the package missing, or a precision this CPU
    does not compute natively), or None."""
    if not installed():
        return "the openvino package is not installed (pip install 'trtserve[openvino]')"
    native = cpu_precisions(import_openvino().Core())
    if entry.inference_precision not in native:
        return f"this CPU does not compute {entry.inference_precision} natively (it does {', '.join(native)})"
    return None


def compile_graph(core, graph, precision: str, threads: int):
    """The portable graph compiled for the CPU: one stream, `threads` threads, `precision` ("bf16" or "f32")
    for every op OpenVINO runs in that precision; what it compiled to is checked, never assumed. Threads are not
    pinned: several workers of one server share the machine's cores as the server places them."""
    compiled = core.compile_model(core.read_model(str(graph)), "CPU", {
        "INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False})
    got = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    expected = {"bf16": "bfloat16", "f32": "float32"}[precision]
    if expected not in got:
        raise TrtServeError(f"OpenVINO compiled the graph in {got}, not the {precision} its build measured")
    return compiled


class OpenVinoBackend:
    name = "openvino"

    def __init__(self, engine: EngineDir, threads: int | None = None, precision: str | None = None):
        """`precision`: override the engine's measured inference precision (the build's gate uses it to try
        each one)."""
        entry = engine.manifest.openvino
        if engine.manifest.kind not in KINDS:
            raise TrtServeError(f"{engine.path} is a {engine.manifest.kind}: the OpenVINO backend runs encoders and "
                                "cross-encoders (on decoders it measured slower than ONNX Runtime)")
        if precision is None:
            if entry is None or not entry.inference_precision:
                raise TrtServeError(f"{engine.path} has no OpenVINO measurement: rebuild it with --backend openvino "
                                    f"(`{engine.rebuild} --backend openvino`)")
            precision = entry.inference_precision
        ov = import_openvino()
        self.engine = engine
        self.inputs, self.outputs = io_specs(engine.manifest)
        self.ranges = engine.manifest.shapes
        self.threads = threads or available_cores()
        self.precision = precision
        assert engine.manifest.onnx is not None
        self._compiled = compile_graph(ov.Core(), engine.file(engine.manifest.onnx.file), precision, self.threads)
        self._request = self._compiled.create_infer_request()
        self._lock = threading.Lock()  # one infer request: calls take turns
        self._names = [spec.name for spec in self.outputs]
        self.abilities = Abilities()

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(feeds, self.inputs, self.ranges)
        with self._lock:
            if self._request is None:
                raise TrtServeError("the OpenVINO backend is closed")
            self._request.infer({name: np.ascontiguousarray(array) for name, array in feeds.items()})
            return {name: np.array(self._request.get_tensor(name).data, copy=True) for name in self._names}

    def close(self) -> None:
        with self._lock:
            self._request = self._compiled = None

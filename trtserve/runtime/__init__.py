"""Backends that run an engine dir: one protocol, several implementations."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

BACKENDS = ("auto", "onnxruntime", "tensorrt", "openvino", "torch")


def runtime_for(engine) -> tuple[str, str]:
    """(backend, why) that `auto` picks for an opened engine dir: its TensorRT plan when this
    machine can run it; else OpenVINO where the build chose it (an encoder measured at the gate and faster
    there) and the openvino package is installed; else the ONNX Runtime graph (the CPU default that always
    works)."""
    entry = engine.manifest.tensorrt
    if engine.manifest.parallel_tracks is not None:
        return "onnxruntime", "a track-sharded engine: its ranks run ONNX Runtime"
    if not entry:
        return _cpu_runtime(engine, "the engine has no TensorRT plan")
    from trtserve.runtime.devices import cuda_device_info
    from trtserve.runtime.trt_lib import flavour_of, import_tensorrt
    from trtserve.runtime.trt_plan import refuse_reason

    trt, _ = import_tensorrt()
    reason = refuse_reason(entry, flavour_of(trt) if trt else None, getattr(trt, "__version__", None),
                           cuda_device_info(), engine.rebuild)
    if reason:
        return _cpu_runtime(engine, f"not the TensorRT plan: {reason}")
    return "tensorrt", "the plan fits this GPU"


def _cpu_runtime(engine, why: str) -> tuple[str, str]:
    entry = engine.manifest.openvino
    if not entry or not entry.chosen:
        return "onnxruntime", why
    from trtserve.runtime.openvino import unservable

    reason = unservable(entry)
    if reason:
        return "onnxruntime", f"{why}; not its OpenVINO part: {reason}"
    return "openvino", f"{why}; OpenVINO in {entry.inference_precision}, as its build chose: {entry.chosen_because}"


def load_backend(engine_dir, backend: str = "onnxruntime", ranks: dict | None = None, **options):
    """Open and verify `engine_dir`, then load it with the named backend (`auto`: see runtime_for). `ranks`: a
    track-sharded engine's rank options (runtime.track_backend.TrackBackend: tracks, threads, timeout, heartbeat)."""
    from trtserve.engine_dir import open_engine_dir
    from trtserve.errors import TrtServeError

    engine = open_engine_dir(engine_dir)
    if engine.manifest.parallel_tracks is not None:  # its ranks run the tracks' ONNX Runtime graphs
        from trtserve.runtime.track_backend import TrackBackend

        if backend not in ("auto", "onnxruntime"):
            raise TrtServeError(f"{engine.path} is track-sharded: it runs with ONNX Runtime only, not {backend}")
        return TrackBackend(engine, **(ranks or {}))
    if backend == "auto":
        backend, _ = runtime_for(engine)
        if backend == "tensorrt":
            options.pop("threads", None)
        if backend == "openvino":  # the build's choice; where OpenVINO cannot load it here, the CPU default
            from trtserve.runtime.openvino import OpenVinoBackend

            try:
                return OpenVinoBackend(engine, **options)
            except Exception as exc:  # noqa: BLE001  (any failure of the optional backend: ONNX Runtime serves)
                log.warning("engine %s: OpenVINO could not load it (%s); ONNX Runtime serves it", engine.path, exc)
                backend = "onnxruntime"
    if backend == "onnxruntime":
        from trtserve.runtime.ort import OrtBackend

        return OrtBackend(engine, **options)
    if backend == "openvino":
        from trtserve.runtime.openvino import OpenVinoBackend

        return OpenVinoBackend(engine, **options)
    if backend == "tensorrt":
        from trtserve.runtime.trt import TrtBackend

        return TrtBackend(engine, **options)
    if backend == "torch":
        from trtserve.runtime.torch_ref import TorchBackend

        return TorchBackend(engine, **options)
    raise TrtServeError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")

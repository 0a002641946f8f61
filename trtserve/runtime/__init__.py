"""Backends that run an engine dir: one protocol, several implementations."""

from __future__ import annotations

BACKENDS = ("auto", "onnxruntime", "tensorrt", "torch")


def runtime_for(engine) -> tuple[str, str]:
    """(backend, why) that `auto` picks for an opened engine dir: its TensorRT plan when this
    machine can run it, else the ONNX Runtime graph (the CPU default that always works)."""
    entry = engine.manifest.tensorrt
    if engine.manifest.parallel_tracks is not None:
        return "onnxruntime", "a track-sharded engine: its ranks run ONNX Runtime"
    if not entry:
        return "onnxruntime", "the engine has no TensorRT plan"
    from trtserve.runtime.devices import cuda_device_info
    from trtserve.runtime.trt_lib import flavour_of, import_tensorrt
    from trtserve.runtime.trt_plan import refuse_reason

    trt, _ = import_tensorrt()
    reason = refuse_reason(entry, flavour_of(trt) if trt else None, getattr(trt, "__version__", None),
                           cuda_device_info(), engine.rebuild)
    return ("onnxruntime", f"not the TensorRT plan: {reason}") if reason else ("tensorrt", "the plan fits this GPU")


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
    if backend == "onnxruntime":
        from trtserve.runtime.ort import OrtBackend

        return OrtBackend(engine, **options)
    if backend == "tensorrt":
        from trtserve.runtime.trt import TrtBackend

        return TrtBackend(engine, **options)
    if backend == "torch":
        from trtserve.runtime.torch_ref import TorchBackend

        return TorchBackend(engine, **options)
    raise TrtServeError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")

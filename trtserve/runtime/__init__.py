"""Backends that run an engine dir: one protocol, several implementations."""

from __future__ import annotations

BACKENDS = ("onnxruntime", "torch")


def load_backend(engine_dir, backend: str = "onnxruntime", **options):
    """Open and verify `engine_dir`, then load it with the named backend."""
    from trtserve.engine_builder.artifact import open_engine_dir
    from trtserve.errors import TrtServeError

    engine = open_engine_dir(engine_dir)
    if backend == "onnxruntime":
        from trtserve.runtime.ort import OrtBackend

        return OrtBackend(engine, **options)
    if backend == "torch":
        from trtserve.runtime.torch_ref import TorchBackend

        return TorchBackend(engine, **options)
    raise TrtServeError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")

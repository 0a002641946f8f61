"""The one place that imports TensorRT: full `tensorrt` first, else `tensorrt_rtx` (TensorRT for RTX,
same Python API). Both are TensorRT 11-style: networks are always strongly typed."""

from __future__ import annotations

import importlib
from types import ModuleType

from trtserve.errors import TrtServeError

FLAVOURS = ("tensorrt", "tensorrt_rtx")
INSTALL_HINT = ("install TensorRT 11 (`pip install tensorrt`, with NVIDIA's package index reachable) or "
                "TensorRT for RTX (`pip install tensorrt-rtx-cu13`)")


def import_tensorrt() -> tuple[ModuleType | None, dict[str, str]]:
    """(the first TensorRT module that imports, {flavour: why it did not import})."""
    why: dict[str, str] = {}
    for name in FLAVOURS:
        try:
            return importlib.import_module(name), why
        except Exception as exc:  # ImportError, or a missing shared library raised as OSError
            why[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None, why


def load_tensorrt() -> tuple[ModuleType, str]:
    """(module, flavour) or a TrtServeError that says why neither flavour is usable."""
    trt, why = import_tensorrt()
    if trt is None:
        reasons = "; ".join(f"{k}: {v}" for k, v in why.items())
        raise TrtServeError(f"TensorRT is not available ({reasons}): {INSTALL_HINT}")
    return trt, flavour_of(trt)


def flavour_of(trt: ModuleType) -> str:
    return "tensorrt_rtx" if trt.__name__.startswith("tensorrt_rtx") else "tensorrt"


def logger(trt: ModuleType, keep_verbose: bool = False):
    """An ILogger that keeps messages (for error reports and the build log) instead of printing them."""

    class Logger(trt.ILogger):  # type: ignore[name-defined]  # a base class from the module passed in
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: list[tuple[str, str]] = []

        def log(self, severity, msg):
            name = getattr(severity, "name", str(severity))
            if keep_verbose or name not in ("VERBOSE", "INFO"):
                self.messages.append((name, msg))

        def errors(self) -> list[str]:
            return [m for s, m in self.messages if s in ("ERROR", "INTERNAL_ERROR")]

    return Logger()

"""What accelerators and TensorRT flavours this machine has, without importing heavy libraries."""

from __future__ import annotations

import ctypes
import importlib
import importlib.util


def cuda_devices() -> tuple[int, str]:
    """(number of CUDA devices, reason when 0), via the driver library alone."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, "no NVIDIA driver (libcuda.so.1 not found)"
    if lib.cuInit(0) != 0:
        return 0, "the NVIDIA driver did not initialise (cuInit failed)"
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return 0, "no CUDA device visible"
    return count.value, ""


def tensorrt_flavour() -> tuple[str | None, str]:
    """('tensorrt' | 'tensorrt_rtx' | None, reason when None), checking modules without importing them."""
    for module in ("tensorrt", "tensorrt_rtx", "tensorrt_rtx_bindings"):
        if importlib.util.find_spec(module) is not None:
            return module, ""
    return None, "neither tensorrt nor tensorrt_rtx is installed"


def choose_backend(requested: str) -> tuple[str, str]:
    """Return (backend, why). Only ONNX Runtime builds engines in this version."""
    if requested == "onnxruntime":
        return "onnxruntime", "requested with --backend onnxruntime"
    flavour, why_not = tensorrt_flavour()
    devices, no_gpu = cuda_devices()
    if flavour is None:
        return "onnxruntime", f"auto: {why_not}"
    if devices == 0:
        return "onnxruntime", f"auto: {flavour} is installed but {no_gpu}"
    return "onnxruntime", f"auto: {flavour} and {devices} GPU(s) found, but this version builds ONNX Runtime engines only"

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


RTX_COMPUTE_CAPABILITIES = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")


def choose_backend(requested: str) -> tuple[str, str]:
    """Return (backend, why). `tensorrt` builds a TensorRT plan beside the ONNX Runtime graph."""
    if requested in ("onnxruntime", "tensorrt", "openvino"):
        return requested, f"requested with --backend {requested}"
    flavour, why_not = tensorrt_flavour()
    devices, no_gpu = cuda_devices()
    if flavour is None:
        return "onnxruntime", f"auto: {why_not}"
    if devices == 0:
        return "onnxruntime", f"auto: {flavour} is installed but {no_gpu} (use --backend tensorrt to build anyway)"
    if flavour.startswith("tensorrt_rtx"):
        unsupported = [d for d in cuda_device_info() if d["compute_capability"] not in RTX_COMPUTE_CAPABILITIES]
        if unsupported:
            return "onnxruntime", (f"auto: TensorRT-RTX does not support {unsupported[0]['name']} (compute capability "
                                   f"{unsupported[0]['compute_capability']}); full TensorRT is needed")
    return "tensorrt", f"auto: {flavour} and {devices} GPU(s) found"


def cuda_device_info() -> list[dict]:
    """Name and compute capability of each visible CUDA device, via the driver library alone."""
    count, _ = cuda_devices()
    if not count:
        return []
    lib = ctypes.CDLL("libcuda.so.1")
    found = []
    for index in range(count):
        device, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGet(ctypes.byref(device), index)
        lib.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # ..._MINOR
        lib.cuDeviceGetName(name, 256, device)
        found.append({"index": index, "name": name.value.decode(errors="replace"),
                      "compute_capability": f"{major.value}.{minor.value}"})
    return found

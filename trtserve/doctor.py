"""`trtserve doctor`: every backend, its version, and why it can or cannot build or run engines here."""

from __future__ import annotations

import importlib
import platform
import sys


def _version(module: str) -> tuple[str | None, str]:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown"), ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]


def _openvino_why() -> str:
    from trtserve.runtime.openvino import cpu_precisions, import_openvino

    return f"CPU precisions: {', '.join(cpu_precisions(import_openvino().Core()))}"


def report() -> dict:
    from trtserve import __version__
    from trtserve.runtime.devices import RTX_COMPUTE_CAPABILITIES, cuda_device_info, cuda_devices

    gpus, no_gpu = cuda_devices()
    devices = cuda_device_info()
    backends = []

    ort, why = _version("onnxruntime")
    providers = importlib.import_module("onnxruntime").get_available_providers() if ort else []
    backends.append({"name": "onnxruntime", "version": ort, "build": bool(ort), "run": bool(ort),
                     "why": f"providers: {', '.join(providers)}" if ort else f"{why}: pip install onnxruntime"})

    torch, why = _version("torch")
    cuda = ""
    if torch:
        import torch as _torch

        cuda = f"CUDA {_torch.version.cuda}, {_torch.cuda.device_count()} device(s)" if _torch.cuda.is_available() \
            else "CPU build or no usable GPU"
    backends.append({"name": "torch (fp32 reference, export)", "version": torch, "build": bool(torch),
                     "run": bool(torch), "why": cuda if torch else f"{why}: pip install 'trtserve[export]'"})

    trt, why = _version("tensorrt")
    backends.append({"name": "tensorrt", "version": trt, "build": bool(trt) and gpus > 0,
                     "run": bool(trt) and gpus > 0,
                     "why": (f"{why}: install TensorRT 11 from NVIDIA's package index" if not trt
                             else "" if gpus else f"installed, but {no_gpu}: full TensorRT builds and runs on a GPU")})

    rtx, why = _version("tensorrt_rtx")
    supported = [d for d in devices if d["compute_capability"] in RTX_COMPUTE_CAPABILITIES]
    if not rtx:
        rtx_why = f"{why}: pip install tensorrt-rtx-cu13"
    elif not gpus:
        rtx_why = f"builds portable plans without a GPU; running one needs a GPU ({no_gpu})"
    elif not supported:
        rtx_why = (f"builds plans, but no visible GPU has a compute capability it supports "
                   f"({', '.join(RTX_COMPUTE_CAPABILITIES)}); use full TensorRT")
    else:
        rtx_why = ""
    backends.append({"name": "tensorrt_rtx", "version": rtx, "build": bool(rtx), "run": bool(rtx and supported),
                     "why": rtx_why})

    openvino, why = _version("openvino")
    openvino = openvino and openvino.split("-")[0]  # 2026.4.1, not the build string after it
    backends.append({"name": "openvino (encoders)", "version": openvino, "build": bool(openvino),
                     "run": bool(openvino), "why": _openvino_why() if openvino else
                     f"{why}: pip install 'trtserve[openvino]'"})

    cuda_python, why = _version("cuda.bindings")
    backends.append({"name": "cuda-bindings (device buffers)", "version": cuda_python, "build": False,
                     "run": bool(cuda_python) and gpus > 0,
                     "why": "" if cuda_python and gpus else (no_gpu if cuda_python else f"{why} (optional)")})
    return {"trtserve": __version__, "python": sys.version.split()[0], "machine": platform.machine(),
            "cuda_devices": devices, "no_gpu_reason": no_gpu, "backends": backends}


def render(facts: dict) -> str:
    lines = [f"trtserve {facts['trtserve']}, Python {facts['python']}, {facts['machine']}"]
    if facts["cuda_devices"]:
        for d in facts["cuda_devices"]:
            lines.append(f"GPU {d['index']}: {d['name']} (compute capability {d['compute_capability']})")
    else:
        lines.append(f"GPU: none ({facts['no_gpu_reason']})")
    lines.append(f"{'backend':<32} {'version':<12} {'build':<6} {'run':<6} notes")
    for b in facts["backends"]:
        lines.append(f"{b['name']:<32} {b['version'] or '-':<12} {'yes' if b['build'] else 'no':<6} "
                     f"{'yes' if b['run'] else 'no':<6} {b['why']}")
    return "\n".join(lines)

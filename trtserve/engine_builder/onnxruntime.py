"""ONNX Runtime "engine": the graph after ORT's optimizations, saved once at build time."""

from __future__ import annotations

import platform
from pathlib import Path

OPTIMIZED = "model.ort.onnx"


def build_ort(onnx_path: Path, out_dir: Path) -> dict:
    """Optimize `onnx_path` with every ORT graph optimization; return the manifest's backend entry."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(out_dir / OPTIMIZED)
    options.log_severity_level = 3  # the "hardware specific" notice: the manifest records the machine
    ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    return {
        "name": "onnxruntime",
        "graph": OPTIMIZED,
        "portable_graph": onnx_path.name,
        "graph_optimization_level": "ORT_ENABLE_ALL",
        "providers": ["CPUExecutionProvider"],
        "onnxruntime_version": ort.__version__,
        "machine": platform.machine(),
    }

"""ONNX Runtime "engine": the graph after ORT's optimizations, saved once at build time."""

from __future__ import annotations

import platform
from pathlib import Path

OPTIMIZED = "model.ort.onnx"


# MatMulNBits' accuracy_level: 0 computes in fp32 (the input's type), 4 quantizes each block of the input
# to int8 and runs integer dot products (what llama.cpp does for its quantized formats): about twice as fast
# for 4-bit weights, and far faster for 8-bit ones (ONNX Runtime 1.32 has no fast fp32 path for those).
INT8_ACTIVATIONS = 4
FLOAT_ACTIVATIONS = 0


def build_ort(onnx_path: Path, out_dir: Path, int8_activations: frozenset | None = None) -> dict:
    """Optimize `onnx_path` with every ORT graph optimization; return the manifest's backend entry.

    ONNX Runtime fuses each blocked DequantizeLinear -> MatMul pair into a MatMulNBits node named as the
    MatMul; those in `int8_activations` ("*": all) run on int8 activations, the others on fp32 ones. The
    choice lives in the optimized graph only, never in the portable one."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(out_dir / OPTIMIZED)
    options.log_severity_level = 3  # the "hardware specific" notice: the manifest records the machine
    ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    levels = _set_accuracy_levels(out_dir / OPTIMIZED, int8_activations) if int8_activations is not None else {}
    return {
        "name": "onnxruntime",
        "graph": OPTIMIZED,
        "portable_graph": onnx_path.name,
        "graph_optimization_level": "ORT_ENABLE_ALL",
        **({"matmulnbits_accuracy_levels": levels} if levels else {}),
        "providers": ["CPUExecutionProvider"],
        "onnxruntime_version": ort.__version__,
        "machine": platform.machine(),
    }


def _set_accuracy_levels(graph: Path, int8_activations: frozenset) -> dict:
    """Give every MatMulNBits node its accuracy level; return how many nodes got each."""
    import onnx

    model = onnx.load(str(graph))
    counts = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        level = INT8_ACTIVATIONS if "*" in int8_activations or node.name in int8_activations else FLOAT_ACTIVATIONS
        attributes = [a for a in node.attribute if a.name != "accuracy_level"]
        del node.attribute[:]
        node.attribute.extend(attributes + [onnx.helper.make_attribute("accuracy_level", level)])
        counts[str(level)] = counts.get(str(level), 0) + 1
    onnx.save(model, str(graph))
    return counts

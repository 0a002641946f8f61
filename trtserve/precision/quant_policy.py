"""The int8 and int4 policies: a genuine-fp32 checkpoint's GEMM and embedding weights quantized in blocks
(precision.weight_quant), each weight in the format precision.sensitivity chose for it by measurement,
written as blocked DequantizeLinear -> MatMul / Gather (precision.blocked)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trtserve.graph_files import tensor_array
from trtserve.precision.blocked import INT8_FORMATS, Pending, weight_candidates, write_blocks
from trtserve.precision.gguf_blocks import BLOCK
from trtserve.precision.sensitivity import weight_key
from trtserve.precision.weight_quant import quantize_rows

KEPT = ("kept fp32 by the activation plan: 8-bit weights on fp32 activations have no fast kernel in "
        "ONNX Runtime 1.32")


def candidates(model, base: Path | None = None) -> tuple[dict, set]:
    """Every quantizable weight of the graph by key ({key: its shape as rows (N, K)}), and the keys that start at
    8 bits (embedding tables and the LM head: their own choice). A graph loaded without its weights reads each
    from its file under `base`, one at a time."""
    from trtserve.precision.activations import lm_head

    head = lm_head(model)
    weights, eight_bit = {}, set()
    for node, kind, rows, _ in weight_candidates(model.graph, base):
        key = weight_key(kind, rows)
        weights[key] = tuple(int(n) for n in rows.shape)
        if kind == "embeddings" or node.name == head:
            eight_bit.add(key)
    return weights, eight_bit


def apply_quantized(model, choice, int8_activations: frozenset | None = None, base: Path | None = None):
    """Rewrite `model` in place with the formats of `choice` (a sensitivity.Choice); return it and a report.

    With `int8_activations` given (an activation plan's GEMMs; "*": all), an 8-bit GEMM outside it keeps
    fp32 weights. A graph loaded without its weights reads each from its file under `base` as it is reached and
    quantizes it as it is written (blocked.Pending): one weight's fp32 rows in memory at a time."""
    found, report = {}, {"gemms": {}, "embeddings": {}, "fp32": {}, "calibration": choice.whole,
                         "kept_safer": choice.kept}
    if choice.kept_by_calibration is not None:  # the gate missed with fewer: `calibration` is that smaller mix's
        report["kept_safer_by_calibration"] = choice.kept_by_calibration
    inits = {i.name: i for i in model.graph.initializer}
    for node, kind, rows, weight in weight_candidates(model.graph, base):
        key = weight_key(kind, rows)
        fmt = choice.formats.get(key, "fp32")
        fast = int8_activations is None or "*" in int8_activations or node.name in int8_activations
        entry = {"shape": [int(rows.shape[1]), int(rows.shape[0])], "module": choice.modules.get(key),
                 "sensitivity": choice.sensitivity.get(key)}
        if fmt != "fp32" and kind == "gemms" and fmt in INT8_FORMATS and not fast:
            report["fp32"][node.name] = {**entry, "reason": KEPT}
        elif fmt == "fp32":
            reason = (f"input dimension {rows.shape[1]} is no multiple of the block size {BLOCK}"
                      if rows.shape[1] % BLOCK else "kept fp32 by the sensitivity choice" if key in choice.sensitivity
                      else "not found in the reference model")
            report["fp32"][node.name] = {**entry, "reason": reason}
        else:
            transposed = kind == "gemms" and node.input[1] == weight  # a MatMul's [K, N] initializer itself
            found[node.name] = (kind, Pending(fmt, fmt == "int4",
                                              _quantizer(rows, fmt, weight, transposed, inits, base)))
            report[kind][node.name] = {**entry, "format": fmt}
    write_blocks(model, found, report)
    return model, report


def _quantizer(rows: np.ndarray, fmt: str, weight: str, transposed: bool, inits: dict, base: Path | None):
    """The call that quantizes one weight when the writer reaches it. A graph that holds no weights reads the
    weight's rows again from its file then, so that no fp32 rows wait in memory; else the rows in hand."""
    if base is None:
        return lambda: quantize_rows(np.ascontiguousarray(rows), fmt, weight)

    def compute():
        values = tensor_array(inits[weight], base)
        return quantize_rows(np.ascontiguousarray(values.T if transposed else values), fmt, weight)

    return compute

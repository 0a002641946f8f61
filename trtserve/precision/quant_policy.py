"""The int8 and int4 policies: a genuine-fp32 checkpoint's GEMM and embedding weights quantized in blocks
(precision.weight_quant), each weight in the format precision.sensitivity chose for it by measurement,
written as blocked DequantizeLinear -> MatMul / Gather (precision.blocked)."""

from __future__ import annotations

import numpy as np

from trtserve.precision.blocked import INT8_FORMATS, weight_candidates, write_blocks
from trtserve.precision.gguf_blocks import BLOCK
from trtserve.precision.sensitivity import weight_key
from trtserve.precision.weight_quant import quantize_rows

KEPT = ("kept fp32 by the activation plan: 8-bit weights on fp32 activations have no fast kernel in "
        "ONNX Runtime 1.32")


def candidates(model) -> tuple[dict, set]:
    """Every quantizable weight of the graph by key ({key: rows [N, K]}), and the keys that start at 8 bits
    (embedding tables and the LM head: their own choice)."""
    from trtserve.precision.activations import lm_head

    head = lm_head(model)
    weights, eight_bit = {}, set()
    for node, kind, rows, _ in weight_candidates(model.graph):
        key = weight_key(kind, rows)
        weights[key] = rows
        if kind == "embeddings" or node.name == head:
            eight_bit.add(key)
    return weights, eight_bit


def apply_quantized(model, choice, int8_activations: frozenset | None = None):
    """Rewrite `model` in place with the formats of `choice` (a sensitivity.Choice); return it and a report.

    With `int8_activations` given (an activation plan's GEMMs; "*": all), an 8-bit GEMM outside it keeps
    fp32 weights."""
    found, report = {}, {"gemms": {}, "embeddings": {}, "fp32": {}, "calibration": choice.whole,
                         "kept_safer": choice.kept}
    if choice.kept_by_calibration is not None:  # the gate missed with fewer: `calibration` is that smaller mix's
        report["kept_safer_by_calibration"] = choice.kept_by_calibration
    blocks_of = {}
    for node, kind, rows, weight in weight_candidates(model.graph):
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
            if (key, fmt) not in blocks_of:
                blocks_of[key, fmt] = quantize_rows(np.ascontiguousarray(rows), fmt, weight)
            found[node.name] = (kind, blocks_of[key, fmt])
            report[kind][node.name] = {**entry, "format": fmt}
    write_blocks(model, found, report)
    return model, report

"""The gguf policy: every GEMM and embedding whose weights came from a GGUF file reads that file's own
blocks (Q4_1, Q8_0) instead of their fp32 dequantization; nothing is re-quantized, so the graph
computes what the checkpoint holds. Weights with no GGUF blocks behind them stay fp32, and say so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import helper, numpy_helper

from trtserve.precision.blocked import OPSET, Rewrite
from trtserve.precision.gguf_blocks import BLOCK, BlockIndex, read_blocks


def _ranks(graph) -> dict:
    values = list(graph.value_info) + list(graph.input) + list(graph.output)
    return {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}


def _weight_rows(name: str, inits: dict, producers: dict) -> tuple[np.ndarray | None, str | None]:
    """The [N, K] rows of a MatMul's fp32 weight: an initializer [K, N], or Transpose of one [N, K]."""
    if name in inits:
        return numpy_helper.to_array(inits[name]).T, name
    node = producers.get(name)
    if node is not None and node.op_type == "Transpose" and node.input[0] in inits \
            and list(helper.get_attribute_value(a) for a in node.attribute if a.name == "perm") in ([], [[1, 0]]):
        return numpy_helper.to_array(inits[node.input[0]]), node.input[0]
    return None, None


KEPT = "kept fp32 by the activation plan: fp32 activations, and no fast kernel for 8-bit weights on them"


def apply_gguf(model, gguf: Path, keep: frozenset = frozenset()):
    """Rewrite `model` (an fp32 export of the checkpoint converted from `gguf`) in place; return it and a report.

    GEMMs named in `keep` keep their fp32 weights."""
    index = BlockIndex(read_blocks(gguf))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    rewrite = Rewrite(_ranks(graph))
    report = {"source": gguf.name, "gemms": {}, "embeddings": {}, "fp32": {}}
    nodes = []
    for node in graph.node:
        kind, rows = None, None
        if node.op_type == "MatMul":
            rows, weight = _weight_rows(node.input[1], inits, producers)
            kind = "gemms"
        elif node.op_type == "Gather" and node.input[0] in inits and not any(a.name == "axis" and a.i for a in node.attribute):
            rows, weight, kind = numpy_helper.to_array(inits[node.input[0]]), node.input[0], "embeddings"
        if node.name in keep:
            report["fp32"][node.name] = KEPT
        elif rows is not None and rows.dtype == np.float32 and rows.ndim == 2:
            blocks = index.match(rows) if rows.shape[1] % BLOCK == 0 else None
            if blocks is None:
                report["fp32"][node.name] = f"weight {weight} {list(rows.shape)}: no GGUF Q4_1/Q8_0 tensor holds these rows"
            elif kind == "embeddings" and blocks.minimum is not None:
                report["fp32"][node.name] = f"embedding {weight}: {blocks.format} tables stay fp32 (no DequantizeLinear form)"
            else:
                (rewrite.matmul if kind == "gemms" else rewrite.gather)(node, blocks)
                report[kind][node.name] = {"format": blocks.format, "gguf_tensor": blocks.name,
                                           "shape": [int(rows.shape[1]), int(rows.shape[0])]}
        before, after = rewrite.take()
        nodes += before + [node] + after
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(rewrite.initializers)
    _drop_dead(graph)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, OPSET)
    return model, report


def _drop_dead(graph) -> None:
    """Remove nodes nothing reads (the fp32 Transpose of a rewired weight) and unused initializers."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    used = {i for n in graph.node for i in n.input} | outputs
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)

"""The gguf policy: every GEMM and embedding whose weights came from a GGUF file reads that file's own
blocks (Q4_1, Q8_0) instead of their fp32 dequantization; nothing is re-quantized, so the graph
computes what the checkpoint holds. Weights with no GGUF blocks behind them stay fp32, and say so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import helper, numpy_helper

from trtserve.precision.blocked import OPSET, Rewrite
from trtserve.precision.gguf_blocks import BLOCK, BlockIndex, Blocks, read_blocks


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


def apply_gguf(model, gguf: Path, keep: frozenset = frozenset(), index: BlockIndex | None = None):
    """Rewrite `model` (an fp32 export of the checkpoint converted from `gguf`) in place; return it and a report.

    GEMMs named in `keep` keep their fp32 weights; `index` is the file's blocks when the caller already read
    them (a build that rewrites the graph for several activation plans). GEMMs that read one input with blocks of one format
    (a layer's query, key and value; gate and up) become one GEMM over their concatenated rows and a
    Split: fewer, wider kernels and one block-minimum product instead of several."""
    graph = model.graph
    found, report = _match(graph, index or BlockIndex(read_blocks(gguf)), keep)
    report["source"] = gguf.name
    groups: dict[tuple, list] = {}
    for node in graph.node:
        if node.name in found and found[node.name][0] == "gemms":
            blocks = found[node.name][1]
            groups.setdefault((node.input[0], blocks.format, blocks.minimum is None), []).append(node)
    rewrite, nodes, fused_away = Rewrite(_ranks(graph)), [], set()
    for node in graph.node:
        if node.name in fused_away:
            continue
        if node.name in found:
            kind, blocks = found[node.name]
            group = groups.get((node.input[0], blocks.format, blocks.minimum is None), []) if kind == "gemms" else []
            if len(group) > 1:
                _fuse(rewrite, group, [found[n.name][1] for n in group], report)
                fused_away.update(n.name for n in group[1:])
            else:
                (rewrite.matmul if kind == "gemms" else rewrite.gather)(node, blocks)
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


def _match(graph, index: BlockIndex, keep: frozenset) -> tuple[dict, dict]:
    """The GGUF blocks behind each MatMul and Gather weight ({node: (kind, blocks)}), and the report."""
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    found, report = {}, {"gemms": {}, "embeddings": {}, "fp32": {}}
    for node in graph.node:
        kind, rows = None, None
        if node.op_type == "MatMul":
            rows, weight = _weight_rows(node.input[1], inits, producers)
            kind = "gemms"
        elif node.op_type == "Gather" and node.input[0] in inits and not any(a.name == "axis" and a.i for a in node.attribute):
            rows, weight, kind = numpy_helper.to_array(inits[node.input[0]]), node.input[0], "embeddings"
        if rows is None or rows.dtype != np.float32 or rows.ndim != 2:
            continue
        blocks = index.match(rows) if rows.shape[1] % BLOCK == 0 and node.name not in keep else None
        if node.name in keep:
            report["fp32"][node.name] = KEPT
        elif blocks is None:
            report["fp32"][node.name] = f"weight {weight} {list(rows.shape)}: no GGUF Q4_1/Q8_0 tensor holds these rows"
        elif kind == "embeddings" and blocks.minimum is not None:
            report["fp32"][node.name] = f"embedding {weight}: {blocks.format} tables stay fp32 (no DequantizeLinear form)"
        else:
            found[node.name] = (kind, blocks)
            report[kind][node.name] = {"format": blocks.format, "gguf_tensor": blocks.name,
                                       "shape": [int(rows.shape[1]), int(rows.shape[0])]}
    return found, report


def _fuse(rewrite: Rewrite, group: list, blocks: list[Blocks], report: dict) -> None:
    """One MatMul over the rows of every GEMM in `group` (they share their input), split back."""
    first = group[0]
    joined = Blocks("+".join(b.name for b in blocks), blocks[0].format, np.concatenate([b.q for b in blocks]),
                    np.concatenate([b.scale for b in blocks]),
                    None if blocks[0].minimum is None else np.concatenate([b.minimum for b in blocks]))
    outputs = [n.output[0] for n in group]
    first.output[0] = f"{first.name}.joined"
    rewrite.matmul(first, joined)
    sizes = rewrite.constant(np.array([b.q.shape[0] for b in blocks], np.int64), f"{first.name}.split_sizes")
    rewrite.after.append(helper.make_node("Split", [f"{first.name}.joined", sizes], outputs, name=f"{first.name}.split",
                                          axis=-1))
    for node in group:
        report["gemms"][node.name]["computed_with"] = [n.name for n in group]


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

"""The gguf policy: every GEMM and embedding whose weights came from a GGUF file reads that file's own
blocks (Q4_1, Q8_0) instead of their fp32 dequantization; nothing is re-quantized, so the graph
computes what the checkpoint holds. Weights with no GGUF blocks behind them stay fp32, and say so."""

from __future__ import annotations

from pathlib import Path

from trtserve.precision.blocked import weight_candidates, write_blocks
from trtserve.precision.gguf_blocks import BLOCK, BlockIndex, read_blocks

KEPT = "kept fp32 by the activation plan: fp32 activations, and no fast kernel for 8-bit weights on them"


def apply_gguf(model, gguf: Path, keep: frozenset = frozenset(), index: BlockIndex | None = None,
               base: Path | None = None):
    """Rewrite `model` (an fp32 export of the checkpoint converted from `gguf`) in place; return it and a report.

    GEMMs named in `keep` keep their fp32 weights; `index` is the file's blocks when the caller already read
    them (a build that rewrites the graph for several activation plans); `base`: the folder of the weights of a
    graph loaded without them. GEMMs sharing an input are joined (blocked.write_blocks)."""
    found, report = _match(model.graph, index or BlockIndex(read_blocks(gguf)), keep, base)
    report["source"] = gguf.name
    write_blocks(model, found, report)
    return model, report


def _match(graph, index: BlockIndex, keep: frozenset, base: Path | None) -> tuple[dict, dict]:
    """The GGUF blocks behind each MatMul and Gather weight ({node: (kind, blocks)}), and the report."""
    report: dict[str, dict]
    found, report = {}, {"gemms": {}, "embeddings": {}, "fp32": {}}
    for node, kind, rows, weight in weight_candidates(graph, base):
        blocks = index.match(rows) if rows.shape[1] % BLOCK == 0 and node.name not in keep else None
        if node.name in keep:
            report["fp32"][node.name] = KEPT
        elif blocks is None:
            report["fp32"][node.name] = f"weight {weight} {list(rows.shape)}: no GGUF Q4_1/Q8_0 tensor holds these rows"
        elif kind == "embeddings" and blocks.minimum is not None:
            report["fp32"][node.name] = (f"embedding {weight}: {blocks.format} tables stay fp32 "
                                         "(no DequantizeLinear form)")
        else:
            found[node.name] = (kind, blocks)
            report[kind][node.name] = {"format": blocks.format, "gguf_tensor": blocks.name,
                                       "shape": [int(rows.shape[1]), int(rows.shape[0])]}
    return found, report

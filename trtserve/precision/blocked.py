"""Weight-only quantized GEMMs written into the portable graph as standard ONNX (opset 21).

A weight W [K, N] feeding MatMul becomes DequantizeLinear(q, scale, axis=0, block_size=32) -> MatMul
with q int8 or int4 and no zero point:
ONNX Runtime fuses that pair into one MatMulNBits node at load, and TensorRT reads it as a weight-only
quantized layer (an INT4/INT8 constant, DEQUANTIZE, MATRIX_MULTIPLY). A block minimum (GGUF Q4_1,
w = d * q + m) has no place in DequantizeLinear, whose zero point is an integer; it is carried
exactly by its share of the product, x @ M[block] summed over each block of x:
    x @ W = x @ DQ(q, d) + blocksum(x) @ M,   blocksum(x)[..., b] = sum of x[..., 32b:32b+32].
An embedding table read by Gather reads it through DequantizeLinear too (ONNX Runtime's optimized graph
turns the pair into GatherBlockQuantized, which dequantizes the gathered rows only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from trtserve.graph_files import tensor_array
from trtserve.graph_index import producers, prune
from trtserve.precision.gguf_blocks import BLOCK, Blocks

OPSET = 21  # blocked DequantizeLinear and the 4-bit types
INT8_FORMATS = ("Q8_0", "int8")


def int_tensor(values: np.ndarray, name: str, dtype: str) -> TensorProto:
    """An int8, uint8 or int4 initializer; int4 packs two values a byte, the first in the low nibble."""
    if dtype in ("int8", "uint8"):
        return numpy_helper.from_array(np.ascontiguousarray(values, dtype=dtype), name)
    flat = (np.ascontiguousarray(values, dtype=np.int8).ravel() & 0x0F).astype(np.uint8)  # two's complement nibbles
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    packed = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    tensor = TensorProto(name=name, data_type=TensorProto.INT4, dims=list(values.shape))
    tensor.raw_data = packed.tobytes()
    return tensor


@dataclass(frozen=True)
class Pending:
    """Blocks computed only when the writer reaches their node (a graph's weights are never all quantized in
    memory at once): their format, whether they carry a block minimum, and the call that computes them."""

    format: str
    has_minimum: bool
    compute: Callable[[], Blocks]


def _ready(blocks: Blocks | Pending) -> Blocks:
    return blocks.compute() if isinstance(blocks, Pending) else blocks


def _without_minimum(blocks: Blocks | Pending) -> bool:
    return not blocks.has_minimum if isinstance(blocks, Pending) else blocks.minimum is None


@dataclass
class Rewrite:
    """Nodes and initializers to add to one graph; block sums shared between GEMMs reading one input."""

    ranks: dict
    nodes: list = field(default_factory=list)  # to insert before the node being rewired
    after: list = field(default_factory=list)  # to insert after it
    initializers: list = field(default_factory=list)
    block_sums: dict = field(default_factory=dict)

    def constant(self, array: np.ndarray, name: str) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def block_sum(self, x: str, k: int) -> str:
        if x not in self.block_sums:
            shape = self.constant(np.array([0] * (self.ranks[x] - 1) + [k // BLOCK, BLOCK], np.int64),
                                  f"{x}.blocks.shape")
            axes = self.constant(np.array([-1], np.int64), f"{x}.blocks.axes")
            self.nodes += [helper.make_node("Reshape", [x, shape], [f"{x}.blocks"], name=f"{x}.blocks"),
                           helper.make_node("ReduceSum", [f"{x}.blocks", axes], [f"{x}.blocksum"],
                                            name=f"{x}.blocksum", keepdims=0)]
            self.block_sums[x] = f"{x}.blocksum"
        return self.block_sums[x]

    def matmul(self, node, blocks: Blocks) -> None:
        """Rewire MatMul(x, W) to read W from `blocks` ([N, K] rows, K along the blocks).

        4-bit values are stored signed (q - 8, with m + 8d as the minimum): TensorRT takes INT4 weights
        without a zero point, and d * q + m = d * (q - 8) + (m + 8d)."""
        base = node.name or node.output[0]
        if blocks.minimum is not None:
            blocks = Blocks(blocks.name, blocks.format, blocks.q.astype(np.int8) - 8, blocks.scale,
                            blocks.minimum + 8 * blocks.scale)
        q = int_tensor(blocks.q.T, f"{base}.weight.q", "int8" if blocks.format in INT8_FORMATS else "int4")
        self.initializers.append(q)
        scale = self.constant(np.ascontiguousarray(blocks.scale.T), f"{base}.weight.scale")
        self.nodes.append(helper.make_node("DequantizeLinear", [q.name, scale], [f"{base}.weight"],
                                           name=f"{base}.weight.dq", axis=0, block_size=BLOCK))
        node.input[1] = f"{base}.weight"
        if blocks.minimum is None:
            return
        x, y = node.input[0], node.output[0]
        minimum = self.constant(np.ascontiguousarray(blocks.minimum.T), f"{base}.weight.minimum")
        node.output[0] = f"{base}.scaled"
        self.nodes.append(helper.make_node("MatMul", [self.block_sum(x, blocks.q.shape[1]), minimum], [f"{base}.shift"],
                                           name=f"{base}.shift"))
        self.after.append(helper.make_node("Add", [f"{base}.scaled", f"{base}.shift"], [y], name=f"{base}.add_shift"))

    def gather(self, node, blocks: Blocks) -> None:
        """Rewire Gather(table, ids) to gather from DequantizeLinear(q, scale, axis=1) (Q8_0 tables only:
        a Q4_1 minimum has no DequantizeLinear form, and TensorRT takes an integer constant only before one)."""
        base = node.name or node.output[0]
        q = int_tensor(blocks.q, f"{base}.table.q", "int8")
        self.initializers.append(q)
        scale = self.constant(np.ascontiguousarray(blocks.scale), f"{base}.table.scale")
        self.nodes.append(helper.make_node("DequantizeLinear", [q.name, scale], [f"{base}.table"],
                                           name=f"{base}.table.dq", axis=1, block_size=BLOCK))
        node.input[0] = f"{base}.table"

    def take(self) -> tuple[list, list]:
        before, after = self.nodes, self.after
        self.nodes, self.after = [], []
        return before, after


def write_blocks(model, found: dict, report: dict) -> None:
    """Rewire every node in `found` ({name: ("gemms" | "embeddings", Blocks or Pending)}) to read its blocks, in
    place; Pending blocks are computed as their node is reached and dropped once written.

    GEMMs that read one input with blocks of one format (a layer's query, key and value; gate and up)
    become one GEMM over their concatenated rows and a Split: fewer, wider kernels and one block-minimum
    product instead of several. `report["gemms"][name]` gains "computed_with" for those."""
    graph = model.graph
    groups: dict[tuple, list] = {}
    for node in graph.node:
        if node.name in found and found[node.name][0] == "gemms":
            blocks = found[node.name][1]
            groups.setdefault((node.input[0], blocks.format, _without_minimum(blocks)), []).append(node)
    fused_away: set[str]
    rewrite, nodes, fused_away = Rewrite(_ranks(graph)), [], set()
    for node in graph.node:
        if node.name in fused_away:
            continue
        if node.name in found:
            kind, blocks = found[node.name]
            group = groups.get((node.input[0], blocks.format, _without_minimum(blocks)), []) if kind == "gemms" else []
            if len(group) > 1:
                _fuse(rewrite, group, [_ready(found[n.name][1]) for n in group], report)
                fused_away.update(n.name for n in group[1:])
            else:
                (rewrite.matmul if kind == "gemms" else rewrite.gather)(node, _ready(blocks))
        before, after = rewrite.take()
        nodes += before + [node] + after
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(rewrite.initializers)
    prune(graph)  # the fp32 weights (and their Transposes) the blocks replaced
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, OPSET)


def _ranks(graph) -> dict:
    values = list(graph.value_info) + list(graph.input) + list(graph.output)
    return {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}


def weight_rows(name: str, inits: dict, producers: dict,
                base: Path | None = None) -> tuple[np.ndarray | None, str | None]:
    """The [N, K] rows of a MatMul's fp32 weight: an initializer [K, N], or Transpose of one [N, K]. External
    weights are read from their files under `base` (graph_files.tensor_array), one at a time."""
    if name in inits:
        return tensor_array(inits[name], base).T, name
    node = producers.get(name)
    if node is not None and node.op_type == "Transpose" and node.input[0] in inits \
            and list(helper.get_attribute_value(a) for a in node.attribute if a.name == "perm") in ([], [[1, 0]]):
        return tensor_array(inits[node.input[0]], base), node.input[0]
    return None, None


def weight_candidates(graph, base: Path | None = None) -> Iterator[tuple]:
    """(node, "gemms" | "embeddings", fp32 rows [N, K], weight name) for each MatMul with a constant 2-D weight
    and each Gather(axis 0) on a 2-D initializer table, read one weight at a time: a graph loaded without its
    weights (graph_files.load_graph(weights=False)) reads each from its file under `base` as it comes."""
    inits = {i.name: i for i in graph.initializer}
    made_by = producers(graph)
    for node in list(graph.node):
        rows = None
        if node.op_type == "MatMul" and _two_dims(node.input[1], inits, made_by):
            rows, weight = weight_rows(node.input[1], inits, made_by, base)
            kind = "gemms"
        elif node.op_type == "Gather" and node.input[0] in inits and _fp32_matrix(inits[node.input[0]]) \
                and not any(a.name == "axis" and a.i for a in node.attribute):
            rows, weight, kind = tensor_array(inits[node.input[0]], base), node.input[0], "embeddings"
        if rows is not None and rows.dtype == np.float32 and rows.ndim == 2:
            yield node, kind, rows, weight


def _fp32_matrix(tensor) -> bool:
    return len(tensor.dims) == 2 and tensor.data_type == TensorProto.FLOAT


def _two_dims(name: str, inits: dict, producers: dict) -> bool:
    """Whether a MatMul's weight input is a 2-D fp32 initializer or a Transpose of one (judged without reading
    it)."""
    if name in inits:
        return _fp32_matrix(inits[name])
    node = producers.get(name)
    return node is not None and node.op_type == "Transpose" and node.input[0] in inits \
        and _fp32_matrix(inits[node.input[0]])


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

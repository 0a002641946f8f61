"""Int8 activations with their rounding residual: about 16-bit activations on the fast int8 kernel (an ONNX
Runtime lowering, like the accuracy level; the portable graph keeps the exact product).

MatMulNBits at accuracy level 4 rounds each block of 32 activations to int8 by the block's largest magnitude.
For a GEMM lowered this way the graph computes that rounding's residual r = x - round(x) itself (the same
blocks and rule) and passes it as extra rows of the same call: [x; r] @ W = round(x) @ W + round(r) @ W, summed.
The weights are read once, and what is lost is the residual's own rounding, about 1/254 of the first one.

What it costs, measured (SmolLM2, ONNX Runtime 1.32, 2 threads, AMD EPYC Zen 4, docs/benchmarks.md): the 12
small nodes per input took about as much as the int8 kernel saved at batch 1 (4-bit weights: 85.0 tok/s
against 88.7 on fp32 activations), and with 16 sequences the doubled rows cost 38% (95 against 152 tok/s).
So the build gives the residual only to 8-bit weights, which have no fast kernel on fp32 activations (an
8-bit LM head: 121 ms a step on fp32 activations, 1.8 ms on int8 ones) and would otherwise stay fp32.
"""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from trtserve.graph_index import producers as graph_producers

BLOCK = 32  # MatMulNBits' activation blocks are its weight blocks: every blocked weight here uses 32
ROWS = ".residual.rows"  # the suffix of the Concat that feeds a GEMM its activations and their residual


BIAS = 5  # MatMulNBits' optional bias input (ONNX Runtime folds a following Add into it)


def residual_gemms(model) -> frozenset:
    """The MatMulNBits nodes of `model` that read their input with its residual rows."""
    producers = graph_producers(model.graph)
    return frozenset(n.name for n in model.graph.node if n.op_type == "MatMulNBits"
                     and getattr(producers.get(n.input[0]), "name", "").endswith(ROWS))


def activation_lowerings(model) -> dict:
    """Each MatMulNBits node's accuracy level, and whether it reads residual rows: what two graphs of one engine
    must agree on."""
    rows = residual_gemms(model)
    return {n.name: (next((a.i for a in n.attribute if a.name == "accuracy_level"), 0), n.name in rows)
            for n in model.graph.node if n.op_type == "MatMulNBits"}


def takes_residual(node) -> bool:
    """Whether a MatMulNBits node can take residual rows: 8-bit weights in blocks of 32 over an input dimension
    made of whole blocks (the residual's blocks must be the kernel's)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (node.op_type == "MatMulNBits" and attrs.get("bits") == 8 and attrs.get("block_size") == BLOCK
            and attrs.get("K", 0) % BLOCK == 0)


def add_residual_rows(model, names) -> frozenset:
    """Give each MatMulNBits node named in `names` ("*": every one) that `takes_residual` its input's int8
    rounding residual as extra rows, and sum the two halves of its output (then add its bias, once); GEMMs
    reading one input share the residual, and a GEMM that has residual rows already is left alone. In place;
    returns the names of the GEMMs rewritten."""
    graph = model.graph
    constants: dict[str, np.ndarray] = {
        "residual.block_shape": np.array([-1, BLOCK], np.int64), "residual.axes": np.array([-1], np.int64),
        "residual.levels": np.array(127.0, np.float32), "residual.smallest": np.array(1e-30, np.float32)}
    done = residual_gemms(model)
    chosen = frozenset(n.name for n in graph.node if ("*" in names or n.name in names) and takes_residual(n)
                       and n.name not in done)
    if not chosen:
        return chosen
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items()
                             if k not in {i.name for i in graph.initializer})
    rows_of: dict[str, str] = {}
    out = []
    for node in graph.node:
        if node.op_type != "MatMulNBits" or node.name not in chosen:
            out.append(node)
            continue
        x = node.input[0]
        if x not in rows_of:
            rows_of[x] = f"{x}{ROWS}"
            out += _residual_nodes(x, rows_of[x])
        y = node.output[0]
        bias = node.input[BIAS] if len(node.input) > BIAS else ""
        if bias:  # the bias belongs to the sum, not to each half
            del node.input[BIAS:]
        node.input[0] = rows_of[x]
        node.output[0] = f"{node.name}.with_residual"
        total = f"{node.name}.residual.total" if bias else y
        out += [node,
                helper.make_node("Split", [node.output[0]], [f"{node.name}.rounded", f"{node.name}.residual"],
                                 name=f"{node.name}.residual.split", axis=0, num_outputs=2),
                helper.make_node("Add", [f"{node.name}.rounded", f"{node.name}.residual"], [total],
                                 name=f"{node.name}.residual.sum")]
        if bias:
            out.append(helper.make_node("Add", [total, bias], [y], name=f"{node.name}.residual.bias"))
    del graph.node[:]
    graph.node.extend(out)
    return chosen


def _residual_nodes(x: str, rows: str) -> list:
    """x's blocks rounded as the kernel rounds them (x * 127 / absmax to the nearest integer), the residual,
    and the Concat of x and the residual along the first axis."""
    def node(op, inputs, output, **attrs):
        return helper.make_node(op, inputs, [f"{x}.residual.{output}"], name=f"{x}.residual.{output}", **attrs)

    p = f"{x}.residual."
    return [
        node("Reshape", [x, "residual.block_shape"], "grouped"),
        node("Abs", [p + "grouped"], "abs"),
        node("ReduceMax", [p + "abs", "residual.axes"], "absmax", keepdims=1),
        node("Max", [p + "absmax", "residual.smallest"], "safe_absmax"),
        node("Div", ["residual.levels", p + "safe_absmax"], "inverse_scale"),
        node("Mul", [p + "grouped", p + "inverse_scale"], "scaled"),
        node("Round", [p + "scaled"], "levels"),
        node("Div", [p + "levels", p + "inverse_scale"], "rounded"),
        node("Sub", [p + "grouped", p + "rounded"], "error"),
        node("Shape", [x], "shape"),
        node("Reshape", [p + "error", p + "shape"], "values"),
        helper.make_node("Concat", [x, p + "values"], [rows], name=rows, axis=0),
    ]


def without_rounded_activations(model) -> bool:
    """Undo the activation lowerings in place: residual rows removed (a bias back in its GEMM), every
    MatMulNBits back on fp32 activations (accuracy level 0). Returns whether there was any. Two graphs that
    round activations differ by far more than their fp32 arithmetic does: a difference of 1e-8 in an input
    moves some values across a rounding boundary (measured on SmolLM2 int4: 3e-8 between two attention kernels
    grew to 1e-3 of the largest logit)."""
    graph = model.graph
    producers = graph_producers(graph)
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    dropped, inputs, changed = set(), set(), False
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            continue
        rows = producers.get(node.input[0])
        if rows is not None and rows.name.endswith(ROWS):
            split = readers[node.output[0]][0]
            total = readers[split.output[0]][0]
            bias = readers.get(total.output[0], [None])[0]
            last = bias if bias is not None and bias.name == f"{node.name}.residual.bias" else total
            if last is bias:
                node.input.extend([""] * (BIAS - len(node.input)) + [bias.input[1]])
            node.input[0], node.output[0] = rows.input[0], last.output[0]
            dropped |= {split.name, total.name, last.name}
            inputs.add(rows.input[0])
            changed = True
        level = next((a for a in node.attribute if a.name == "accuracy_level"), None)
        if level is not None and level.i != 0:
            level.i, changed = 0, True
    prefixes = tuple(f"{x}.residual." for x in inputs)
    dropped |= {n.name for n in graph.node if n.name.startswith(prefixes) or n.name in {f"{x}{ROWS}" for x in inputs}}
    kept = [n for n in graph.node if n.name not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    if inputs:
        used = {name for n in graph.node for name in n.input}
        unused = [i for i in graph.initializer if i.name.startswith("residual.") and i.name not in used]
        for init in unused:
            graph.initializer.remove(init)
    return changed

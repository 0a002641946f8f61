"""Overflow probe: per-node activation ranges of the fp32 graph on real text (or random ids),
and the nodes a policy would run in fp16 whose values leave the fp16 range."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trtserve.graph_files import graph_on_disk
from trtserve.precision.passes import FP16_MAX, plan_policy
from trtserve.precision.policy import Policy

SENTINEL = 1e37  # |values| beyond this are mask sentinels (the fp32 minimum), not activations


@dataclass
class Ranges:
    absmax: dict[str, float]  # tensor name -> largest |value| seen, sentinels excluded (inf if NaN/inf)
    over: dict[str, int]  # tensor name -> values beyond the fp16 range (sentinels excluded)
    total: dict[str, int]  # tensor name -> values seen
    producer: dict[str, str]  # tensor name -> node name
    op: dict[str, str]  # node name -> op type
    squared_by: dict[str, list[str]]  # tensor name -> Pow(x, 2) nodes that read it


def activation_ranges(model, feeds_list) -> Ranges:
    """Run the fp32 graph with every float intermediate exposed; keep each tensor's |max|."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from trtserve.precision.passes import infer_shapes

    model = infer_shapes(model)
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(graph.value_info) + list(graph.output)}
    inits = {i.name: i for i in graph.initializer}
    outputs = {v.name for v in graph.output}
    squared: dict[str, list[str]]
    producer, op, squared = {}, {}, {}
    for i, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{i}"
        op[name] = node.op_type
        for out in node.output:
            producer[out] = name
        if (node.op_type == "Pow" and node.input[1] in inits
                and float(numpy_helper.to_array(inits[node.input[1]])) == 2.0):
            squared.setdefault(node.input[0], []).append(name)
    probe = [name for name, t in types.items() if t == TensorProto.FLOAT and name in producer and name not in outputs]
    graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in probe)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every node as exported
    options.log_severity_level = 3
    with graph_on_disk(model) as path:  # by path: a graph past 2 GB cannot be handed over as bytes
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    absmax: dict[str, float] = {}
    over: dict[str, int] = {}
    total: dict[str, int] = {}
    for feeds in feeds_list:
        for name, value in zip(names, session.run(names, feeds)):
            if not value.size or value.dtype.kind != "f":
                continue
            magnitude = np.abs(value)
            real = magnitude[~(magnitude >= SENTINEL) | np.isnan(magnitude)]  # drop mask sentinels
            peak = float("inf") if np.isnan(real).any() else float(real.max(initial=0.0))
            absmax[name] = max(absmax.get(name, 0.0), peak)
            over[name] = over.get(name, 0) + int(np.count_nonzero(real > FP16_MAX))
            total[name] = total.get(name, 0) + int(value.size)
    return Ranges(absmax, over, total, producer, op, squared)


def flagged(ranges: Ranges, model, policy: Policy) -> list[dict]:
    """Nodes that `policy` runs in fp16 whose output (or its square) leaves the fp16 range."""
    _, _, low, _, _ = plan_policy(model, policy)
    out = []
    for tensor, peak in ranges.absmax.items():
        node = ranges.producer.get(tensor)
        if node is None or not low.get(node):
            continue
        if peak > FP16_MAX:
            out.append({"node": node, "op": ranges.op[node], "tensor": tensor, "absmax": peak, "why": "output"})
        elif peak * peak > FP16_MAX and any(low.get(sq) for sq in ranges.squared_by.get(tensor, [])):
            out.append({"node": node, "op": ranges.op[node], "tensor": tensor, "absmax": peak,
                        "why": f"squared by {ranges.squared_by[tensor][0]}"})
    return sorted(out, key=lambda f: -f["absmax"])

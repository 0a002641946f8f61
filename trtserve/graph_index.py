"""One index of an ONNX graph for every pass that reads or rewrites one (precision/, engine_builder/): each
tensor's producer and readers, the initializers and value types, a constant's values (read from the external data
file where the graph was loaded without its weights), node attributes, and pruning what the outputs do not need.
It indexes onnx's own ModelProto, which every pass here holds and graph_files reads without its weights, rather
than onnx_ir's graph (onnxscript's rewriter): no conversion of the structure in and out around each pass."""

from __future__ import annotations

import heapq
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trtserve.graph_files import tensor_array

if TYPE_CHECKING:
    from onnx import GraphProto, NodeProto


def producers(graph: GraphProto) -> dict[str, NodeProto]:
    """Tensor name -> the node that makes it."""
    return {out: node for node in graph.node for out in node.output}


def readers(graph: GraphProto) -> defaultdict[str, list[NodeProto]]:
    """Tensor name -> the nodes that read it, in graph order (an unread name: [])."""
    found: defaultdict[str, list[NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            found[name].append(node)
    return found


def attr(node: NodeProto, name: str, default: Any = None) -> Any:
    """A node attribute's value (onnx.helper.get_attribute_value), or `default`."""
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class GraphIndex:
    """Producers, readers, initializers and value types of one graph; `base`: the folder its external weights are
    read from (a graph loaded without them)."""

    def __init__(self, graph: GraphProto, base: Path | None = None) -> None:
        self.graph, self.base = graph, base
        self.inits = {init.name: init for init in graph.initializer}
        self.producer = producers(graph)
        self.readers = readers(graph)
        self.types: dict[str, int] = {value.name: value.type.tensor_type.elem_type
                      for value in [*graph.input, *graph.value_info, *graph.output]}
        self.types.update((name, init.data_type) for name, init in self.inits.items())

    def const(self, name: str) -> np.ndarray | None:
        """The values of an initializer or a Constant node's output; None for a computed tensor."""
        from onnx import numpy_helper

        init = self.inits.get(name)
        if init is not None:
            return tensor_array(init, self.base)
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return numpy_helper.to_array(node.attribute[0].t)
        return None


def prune(graph: GraphProto) -> None:
    """Keep only the nodes the graph's outputs need and the initializers they read, in place, in topological
    order: where the graph's order already is one, it is kept as it was (nodes made ready in their old order)."""
    nodes = list(graph.node)
    made_by = {out: i for i, node in enumerate(nodes) for out in node.output}
    needed: set[int] = set()
    stack = [made_by[o.name] for o in graph.output if o.name in made_by]
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        stack.extend(made_by[name] for name in nodes[i].input if name in made_by and made_by[name] not in needed)
    waiting = {i: {made_by[name] for name in nodes[i].input if name in made_by} for i in needed}
    after: defaultdict[int, list[int]] = defaultdict(list)
    for i, inputs in waiting.items():
        for j in inputs:
            after[j].append(i)
    ready = [i for i, inputs in waiting.items() if not inputs]
    heapq.heapify(ready)
    order: list[NodeProto] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for k in after[i]:
            waiting[k].discard(i)
            if not waiting[k]:
                heapq.heappush(ready, k)
    if len(order) != len(needed):
        raise ValueError("the graph has a cycle: it cannot be put in topological order")
    read = {name for node in order for name in node.input} | {o.name for o in graph.output}
    inits = [init for init in graph.initializer if init.name in read]
    del graph.node[:]
    graph.node.extend(order)
    del graph.initializer[:]
    graph.initializer.extend(inits)

"""The one graph index every pass uses (trtserve/graph_index.py): producers and readers, constants read from
external data, and pruning that keeps a topological order."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from trtserve.graph_files import load_graph, save_graph
from trtserve.graph_index import GraphIndex, attr, prune


def _graph(nodes):
    weight = numpy_helper.from_array(np.arange(600, dtype=np.float32).reshape(20, 30), "w")
    unused = numpy_helper.from_array(np.ones(3, np.float32), "unused")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 20])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 30])], [weight, unused])
    return helper.make_model(graph)


NODES = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("MatMul", ["r", "w"], ["m"], name="matmul"),
         helper.make_node("Neg", ["m"], ["dead"], name="dead"),  # nothing reads it
         helper.make_node("Transpose", ["m"], ["t"], name="transpose", perm=[1, 0]),
         helper.make_node("Transpose", ["t"], ["y"], name="back", perm=[1, 0])]


def test_the_index_reads_producers_readers_and_constants_from_external_data(tmp_path):
    save_graph(_graph(NODES), tmp_path / "g.onnx")
    model = load_graph(tmp_path / "g.onnx", weights=False)
    index = GraphIndex(model.graph, tmp_path)
    assert index.producer["m"].name == "matmul" and [n.name for n in index.readers["m"]] == ["dead", "transpose"]
    assert index.readers["nobody reads this"] == [] and index.types["w"] == TensorProto.FLOAT
    np.testing.assert_array_equal(index.const("w"), np.arange(600, dtype=np.float32).reshape(20, 30))
    assert index.const("r") is None and attr(index.producer["t"], "perm") == [1, 0]
    assert attr(index.producer["t"], "missing", "default") == "default"


def test_prune_drops_what_no_output_needs_and_keeps_a_topological_order():
    model = _graph(list(NODES))
    prune(model.graph)
    assert [n.name for n in model.graph.node] == ["relu", "matmul", "transpose", "back"]  # its order kept
    assert [i.name for i in model.graph.initializer] == ["w"]
    shuffled = _graph([NODES[4], NODES[1], NODES[3], NODES[0]])  # rewrites append nodes out of order
    prune(shuffled.graph)
    assert [n.name for n in shuffled.graph.node] == ["relu", "matmul", "transpose", "back"]

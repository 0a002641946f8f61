"""Graphs of any size: weights as external data beside the structure, written a tensor at a time, and no
module of the package serializing a graph with its weights in it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtserve import graph_files
from trtserve.errors import TrtServeError

PACKAGE = Path(__file__).resolve().parent.parent / "trtserve"


def _model(seed: int = 0):
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((300, 200), dtype=np.float32)  # 240 KB: external
    bias = rng.standard_normal(200, dtype=np.float32)  # 800 B: stays in the structure
    big = helper.make_tensor("scale", TensorProto.FLOAT, [400], rng.standard_normal(400).tolist())  # float_data
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y0"]),
             helper.make_node("ReduceSum", ["y0"], ["s"], keepdims=0),
             helper.make_node("Mul", ["scale", "s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 300])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [400])],
                              [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b"), big])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), weight


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _reference(model, x):
    with graph_files.graph_on_disk(model) as path:
        return _run(path, x)


def test_weights_go_beside_the_graph_page_aligned_and_the_model_is_left_as_it_was(tmp_path):
    model, weight = _model()
    before = model.SerializeToString()
    data = graph_files.save_graph(model, tmp_path / "model.onnx")
    assert data == tmp_path / "model.onnx.data"
    assert model.SerializeToString() == before  # the caller's model still holds its weights
    structure = graph_files.load_graph(tmp_path / "model.onnx", weights=False)
    external = {t.name: t for t in structure.graph.initializer if graph_files.is_external(t)}
    assert set(external) == {"w", "scale"}  # the 800-byte bias stays in the structure
    assert int({e.key: e.value for e in external["w"].external_data}["offset"]) % graph_files.PAGE == 0
    np.testing.assert_array_equal(graph_files.tensor_array(external["w"], tmp_path), weight)
    assert (tmp_path / "model.onnx").stat().st_size < 2048
    x = np.ones((1, 300), np.float32)
    np.testing.assert_allclose(_run(tmp_path / "model.onnx", x), _reference(model, x), rtol=1e-6)
    onnx.checker.check_model(str(tmp_path / "model.onnx"), full_check=True)


def test_a_structure_rewritten_in_place_copied_and_moved_keeps_its_weights(tmp_path):
    model, _ = _model()
    x = np.random.default_rng(1).standard_normal((1, 300)).astype(np.float32)
    want = _reference(model, x)
    graph_files.save_graph(model, tmp_path / "a.onnx")
    structure = graph_files.load_graph(tmp_path / "a.onnx", weights=False)
    structure.graph.node[1].name = "renamed"
    graph_files.save_graph(structure, tmp_path / "a.onnx")  # reads the data file it replaces
    np.testing.assert_allclose(_run(tmp_path / "a.onnx", x), want, rtol=1e-6)
    (tmp_path / "copy").mkdir()
    graph_files.copy_graph(tmp_path / "a.onnx", tmp_path / "copy" / "b.onnx")
    assert graph_files.graph_files(tmp_path / "copy" / "b.onnx") == [tmp_path / "copy" / "b.onnx",
                                                                      tmp_path / "copy" / "b.onnx.data"]
    graph_files.move_graph(tmp_path / "copy" / "b.onnx", tmp_path / "copy" / "c.onnx")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["c.onnx", "c.onnx.data"]
    np.testing.assert_allclose(_run(tmp_path / "copy" / "c.onnx", x), want, rtol=1e-6)
    assert graph_files.graph_bytes(tmp_path / "copy" / "c.onnx") == sum(
        p.stat().st_size for p in (tmp_path / "copy").iterdir())


def test_a_structure_past_the_message_limit_is_refused_with_its_largest_inline_tensors(tmp_path, monkeypatch):
    model, _ = _model()
    monkeypatch.setenv("TRTSERVE_MAX_PROTO_BYTES", "2000")
    graph_files.save_graph(model, tmp_path / "ok.onnx")  # the weights go out: the structure fits
    with pytest.raises(TrtServeError, match=r"past the 2,000-byte limit .* w 240,000 B"):
        graph_files.save_structure(model, tmp_path / "whole.onnx")  # the weights would go in it


# Calls that serialize a ModelProto whole or write one without external data; only graph_files may.
WHOLE = re.compile(r"onnx\.save(_model)?\(|\.SerializeToString\(\)|onnx\.shape_inference\.infer_shapes\(onnx\.load")


def test_no_module_but_graph_files_serializes_a_graph_whole():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "graph_files.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if WHOLE.search(line) and "# small:" not in line:
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not found, "write graphs through trtserve.graph_files:\n" + "\n".join(found)

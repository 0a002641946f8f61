"""A served graph's weights live in a file beside it (`<graph>.data`), which ONNX Runtime memory-maps:
an embedding table costs resident memory only for the rows that were looked up, and weights repacked
at load are not held twice."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtserve.engine_builder.onnxruntime import map_weights, resident_mb, share_weights, weight_files

VOCAB, WIDTH = 16384, 512  # a 32 MiB fp32 table


def _graph(path, seed: int = 0):
    """`seed` draws the small weight; the table is the same for every seed."""
    table = np.random.default_rng(0).standard_normal((VOCAB, WIDTH), dtype=np.float32)
    weight = np.random.default_rng(seed).standard_normal((WIDTH, 64), dtype=np.float32)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "weight"], ["out"])]
    graph = helper.make_graph(nodes, "table",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "sequence", 64])],
                              [numpy_helper.from_array(table, "table"), numpy_helper.from_array(weight, "weight")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    return table.nbytes


def _run(path, ids):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mapped")
    inline, mapped = root / "inline" / "model.ort.onnx", root / "mapped" / "model.ort.onnx"
    for path in (inline, mapped):
        path.parent.mkdir()
        table_bytes = _graph(path)
    return inline, mapped, map_weights(mapped), table_bytes


def test_weights_move_to_the_file_beside_the_graph_and_give_the_same_outputs(graphs):
    inline, mapped, data, table_bytes = graphs
    assert data == "model.ort.onnx.data"
    assert mapped.stat().st_size < 4096 and (mapped.parent / data).stat().st_size >= table_bytes
    ids = np.array([[1, 77, 16383, 5]], np.int64)
    np.testing.assert_array_equal(_run(mapped, ids), _run(inline, ids))
    map_weights(mapped)  # mapping again rewrites the file rather than appending to it
    assert (mapped.parent / data).stat().st_size < 2 * table_bytes
    np.testing.assert_array_equal(_run(mapped, ids), _run(inline, ids))


def test_a_mapped_table_is_resident_only_where_it_was_read(graphs):
    inline, mapped, _, table_bytes = graphs
    held = {name: resident_mb(path) for name, path in (("inline", inline), ("mapped", mapped))}
    if None in held.values():
        pytest.skip("no /proc on this platform: resident memory cannot be read")
    # run on 4 tokens: the inline graph holds the whole table on the heap, the mapped one a few of its pages
    # (both figures include what loading ONNX Runtime's kernels costs, about 10 MB)
    assert held["inline"] > 0.9 * table_bytes / 1e6, held
    assert held["inline"] - held["mapped"] > 0.8 * table_bytes / 1e6, held


@pytest.mark.parametrize("seed", [0, 1], ids=["every-weight-shared", "one-weight-its-own"])
def test_a_second_graph_reads_the_bytes_the_first_one_already_holds(tmp_path, seed):
    main, other, inline = tmp_path / "model.ort.onnx", tmp_path / "model.kv.onnx", tmp_path / "inline.onnx"
    table_bytes = _graph(main)
    _graph(other, seed)
    _graph(inline, seed)
    map_weights(main), map_weights(other)
    files = share_weights(main, other)
    own = tmp_path / "model.kv.onnx.data"
    if seed == 0:  # the same weights: nothing of its own is left
        assert files == ["model.ort.onnx.data"] and not own.exists()
    else:  # the table is shared, the MatMul weight (128 KiB) is kept in its own file
        assert files == ["model.kv.onnx.data", "model.ort.onnx.data"] and own.stat().st_size < table_bytes / 100
    assert weight_files(other) == files
    ids = np.array([[1, 77, 16383, 5]], np.int64)
    np.testing.assert_array_equal(_run(other, ids), _run(inline, ids))


def test_a_graph_without_large_weights_keeps_them_inline_and_shares_nothing(tmp_path):
    graph = helper.make_graph([helper.make_node("Add", ["x", "bias"], ["y"])], "small",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.ones(4, np.float32), "bias")])
    for name in ("model.ort.onnx", "model.kv.onnx"):
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(tmp_path / name))
        assert map_weights(tmp_path / name) is None
    assert share_weights(tmp_path / "model.ort.onnx", tmp_path / "model.kv.onnx") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.kv.onnx", "model.ort.onnx"]
    assert (ort.InferenceSession(str(tmp_path / "model.kv.onnx")).run(None, {"x": np.zeros(4, np.float32)})[0].tolist()
            == [1] * 4)

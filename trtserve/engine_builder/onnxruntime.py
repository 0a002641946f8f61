"""ONNX Runtime "engine": the graph after ORT's optimizations, saved once at build time."""

from __future__ import annotations

import platform
from pathlib import Path

from trtserve.graph_files import DATA_SUFFIX, PAGE, WEIGHT_BYTES, load_graph, save_graph, save_structure

OPTIMIZED = "model.ort.onnx"


# MatMulNBits' accuracy_level: 0 computes in fp32 (the input's type), 4 quantizes each block of the input
# to int8 and runs integer dot products (what llama.cpp does for its quantized formats): about twice as fast
# for 4-bit weights, and far faster for 8-bit ones (ONNX Runtime 1.32 has no fast fp32 path for those).
INT8_ACTIVATIONS = 4
FLOAT_ACTIVATIONS = 0


def build_ort(onnx_path: Path, out_dir: Path, int8_activations: frozenset | None = None,
              residual: frozenset = frozenset()) -> dict:
    """Optimize `onnx_path` with every ORT graph optimization; return the manifest's backend entry.

    ONNX Runtime fuses each blocked DequantizeLinear -> MatMul pair into a MatMulNBits node named as the
    MatMul; those in `int8_activations` ("*": all) run on int8 activations, the 8-bit ones in `residual` ("*":
    all the others) on int8 activations and their rounding residual (engine_builder/activation_residual.py),
    the rest on fp32 ones. The choice lives in the optimized graph only, never in the portable one."""
    import onnxruntime as ort

    from trtserve.memory import return_freed_memory

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    write_optimized(options, out_dir / OPTIMIZED)
    options.log_severity_level = 3  # the "hardware specific" notice: the manifest records the machine
    # this session only writes the optimized graph: its kernels never run, so they keep no repacked copy of the
    # weights (the graph written is the same; a copy as large as the weights is not made)
    options.add_session_config_entry("session.disable_prepacking", "1")
    ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    return_freed_memory()
    levels = _lower(out_dir / OPTIMIZED, int8_activations, residual) if int8_activations is not None else {}
    return {
        "name": "onnxruntime",
        "graph": OPTIMIZED,
        "portable_graph": onnx_path.name,
        "graph_optimization_level": "ORT_ENABLE_ALL",
        **({"matmulnbits_accuracy_levels": levels} if levels else {}),
        "providers": ["CPUExecutionProvider"],
        "onnxruntime_version": ort.__version__,
        "machine": platform.machine(),
    }


MAPPED_SUFFIX = DATA_SUFFIX  # a served graph's weights: model.ort.onnx -> model.ort.onnx.data


def write_optimized(options, path: Path) -> None:
    """Have the session that `options` open write its optimized graph to `path`, its initializers as external
    data in `<path>.data` (a graph past 2 GB cannot be written whole)."""
    options.optimized_model_filepath = str(path)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                     path.name + MAPPED_SUFFIX)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                     str(WEIGHT_BYTES))


def map_weights(graph: Path) -> str | None:
    """Keep every initializer of 1 KiB or more of `graph` in `<graph>.data` beside it (ONNX external data),
    page-aligned, one tensor at a time; return that file's name (None when there is none).

    ONNX Runtime memory-maps external data on the CPU instead of copying it onto its heap: weights a kernel
    repacks at load (MatMul, MatMulNBits) are read once from the file and never held twice, and the rest
    (an embedding table, block scales) are pages of the file, resident only once read: a table's rows are
    resident only for the tokens that were looked up."""
    data = save_graph(load_graph(graph, weights=False), graph)
    return None if data is None else data.name  # None: no initializer of 1 KiB or more


ALIGN = PAGE  # offsets of tensors rewritten by share_weights: page-aligned, as mapping wants them


def _external(tensor) -> dict:
    return {e.key: e.value for e in tensor.external_data}


def initializer_bytes(model) -> dict[str, int]:
    """Stored bytes of each initializer of `model` (loaded without its external data), by name."""
    return {t.name: int(_external(t)["length"]) if "location" in _external(t) else len(t.raw_data)
            for t in model.graph.initializer}


def _mapped(graph: Path, model):
    """(tensor, (file, offset, length), its bytes) for each mapped initializer of `model`, the graph at `graph`;
    each weight file is opened once."""
    handles = {}
    try:
        for tensor in model.graph.initializer:
            entry = _external(tensor)
            if "location" not in entry:
                continue
            where = (entry["location"], int(entry.get("offset", 0)), int(entry["length"]))
            if where[0] not in handles:
                handles[where[0]] = open(graph.parent / where[0], "rb")
            handles[where[0]].seek(where[1])
            yield tensor, where, handles[where[0]].read(where[2])
    finally:
        for handle in handles.values():
            handle.close()


def weight_files(graph: Path) -> list[str]:
    """The files beside `graph` that hold its mapped initializers."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    return sorted({_external(t)["location"] for t in model.graph.initializer if "location" in _external(t)})


def share_weights(main: Path, other: Path) -> list[str]:
    """Point each mapped initializer of the graph `other` whose bytes `main`'s weight file already holds at
    those bytes, and keep in `other`'s own weight file only the rest (removed when nothing is left); return
    the weight files `other` reads. Two graphs of one engine (the optimized graph and the decode graph) then
    share one copy on disk, and in the page cache when both are loaded."""
    import hashlib

    import onnx

    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    have = {digest(data): where for _, where, data in _mapped(main, onnx.load(str(main), load_external_data=False))}
    model = onnx.load(str(other), load_external_data=False)
    own = other.with_name(other.name + MAPPED_SUFFIX)
    kept, files = bytearray(), set()
    for tensor, _, data in _mapped(other, model):
        where = have.get(digest(data))
        if where is None:
            kept.extend(b"\0" * (-len(kept) % ALIGN))
            where = (own.name, len(kept), len(data))
            kept.extend(data)
        del tensor.external_data[:]
        for key, value in zip(("location", "offset", "length"), where):
            tensor.external_data.add(key=key, value=str(value))
        files.add(where[0])
    if kept:
        own.write_bytes(bytes(kept))
    else:
        own.unlink(missing_ok=True)
    save_structure(model, other)
    return sorted(files)


_RESIDENT = """
import os, sys, numpy as np, onnxruntime as ort
def rss(): return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def dim(d): return d if isinstance(d, int) else 0 if "past" in str(d) else 1 if "batch" in str(d) else 4
options = ort.SessionOptions(); options.intra_op_num_threads = 1; options.log_severity_level = 3
before = rss()
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
feeds = {i.name: np.ones([dim(d) for d in i.shape], np.int64 if "int64" in i.type else np.int32 if "int32" in i.type
                         else np.float32) for i in session.get_inputs()}
session.run(None, feeds)
print(rss() - before)
"""


def resident_mb(graph: Path) -> float | None:
    """Memory a fresh process holds for the graph once loaded and run on 4 tokens (resident set then minus
    before loading), in MB: the weights as ONNX Runtime keeps them, mapped pages that the run read
    included. None where /proc is missing or the graph's inputs are not ids, masks and positions."""
    import subprocess
    import sys

    if not Path("/proc/self/statm").exists():
        return None
    done = subprocess.run([sys.executable, "-c", _RESIDENT, str(graph)], capture_output=True, text=True, timeout=600)
    return round(int(done.stdout.strip()) / 1e6, 1) if done.returncode == 0 and done.stdout.strip() else None


def set_accuracy_level(node, level: int) -> None:
    """Set a MatMulNBits node's accuracy_level attribute (replacing any it has)."""
    import onnx

    kept = [a for a in node.attribute if a.name != "accuracy_level"]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute("accuracy_level", level)])


def _lower(graph: Path, int8_activations: frozenset, residual: frozenset = frozenset()) -> dict:
    """ONNX-Runtime-only lowerings of blocked weights in the optimized graph: each MatMulNBits node's
    accuracy level, the residual rows of those in `residual`, and GatherBlockQuantized for an embedding read
    through DequantizeLinear (which ONNX Runtime 1.32 would otherwise dequantize whole on every call).
    Returns the accuracy-level counts ("4+residual" for GEMMs given residual rows)."""

    from trtserve.engine_builder.activation_residual import add_residual_rows, takes_residual

    model = load_graph(graph)
    int8 = {n.name for n in model.graph.node if n.op_type == "MatMulNBits"
            and ("*" in int8_activations or n.name in int8_activations)}
    with_residual = {n.name for n in model.graph.node if n.name not in int8 and takes_residual(n)
                     and ("*" in residual or n.name in residual)}
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        level = INT8_ACTIVATIONS if node.name in int8 | with_residual else FLOAT_ACTIVATIONS
        set_accuracy_level(node, level)
        key = f"{level}+residual" if node.name in with_residual else str(level)
        counts[key] = counts.get(key, 0) + 1
    add_residual_rows(model, with_residual)
    _gather_block_quantized(model)
    save_graph(model, graph)
    return counts


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _table_dequantize(dq, inits: dict, users: list) -> bool:
    """Whether `dq` dequantizes a 2-D int8 table along its rows and only Gather(axis 0) nodes read it."""
    from onnx import TensorProto

    table, scale = inits.get(dq.input[0]), inits.get(dq.input[1])
    return (table is not None and scale is not None and len(dq.input) == 2 and table.data_type == TensorProto.INT8
            and len(table.dims) == 2 and _attrs(dq).get("axis") == 1 and bool(users)
            and all(u.op_type == "Gather" and _attrs(u).get("axis", 0) == 0 and u.input[0] == dq.output[0]
                    for u in users))


def _gather_block_quantized(model) -> None:
    """DequantizeLinear(int8 table [V, K], scale [V, K/b], axis=1) read only by Gather(axis 0) nodes ->
    GatherBlockQuantized on the table stored as uint8 with zero point 128 (the same values)."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    for dq in [n for n in graph.node if n.op_type == "DequantizeLinear"]:
        users = readers.get(dq.output[0], [])
        if not _table_dequantize(dq, inits, users):
            continue
        table, scale = inits[dq.input[0]], inits[dq.input[1]]
        data = numpy_helper.from_array((numpy_helper.to_array(table).astype(np.int16) + 128).astype(np.uint8),
                                       f"{table.name}.u8")
        zero = numpy_helper.from_array(np.full(tuple(scale.dims), 128, np.uint8), f"{table.name}.zero")
        graph.initializer.extend([data, zero])
        for gather in users:
            fused = helper.make_node("GatherBlockQuantized", [data.name, gather.input[1], scale.name, zero.name],
                                     list(gather.output), name=gather.name, domain="com.microsoft", gather_axis=0,
                                     quantize_axis=1, block_size=_attrs(dq)["block_size"], bits=8)
            graph.node.insert(list(graph.node).index(gather), fused)
            graph.node.remove(gather)
        graph.node.remove(dq)
        graph.initializer.remove(table)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))

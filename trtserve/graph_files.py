"""ONNX files of any size: a graph's structure in `<name>.onnx`, its weights as ONNX external data in
`<name>.onnx.data` beside it.

One protobuf message cannot pass 2 GB, so no graph is ever serialized whole: `save_graph` writes each weight
of `WEIGHT_BYTES` or more to the data file, one tensor at a time (page-aligned, so that ONNX Runtime can map
it), and serializes only the structure; `load_graph(..., weights=False)` reads the structure and leaves the
weights where they are, readable one at a time with `tensor_array`. The limit the structure is held to is
`TRTSERVE_MAX_PROTO_BYTES` (protobuf's own limit unless set): a test sets it small to prove that no step
of a build serializes a graph with its weights in it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from trtserve.errors import TrtServeError

DATA_SUFFIX = ".data"  # model.onnx -> model.onnx.data
WEIGHT_BYTES = 1024  # tensors of this size or more are external data
PAGE = 4096  # offsets of tensors of PAGE bytes or more; smaller ones are 64-byte aligned
PROTO_LIMIT = 2**31 - 1  # protobuf's limit on one serialized message


def proto_limit() -> int:
    return int(os.environ.get("TRTSERVE_MAX_PROTO_BYTES", PROTO_LIMIT))


def data_path(graph: Path) -> Path:
    graph = Path(graph)
    return graph.with_name(graph.name + DATA_SUFFIX)


def _tensors(model):
    """Every tensor of `model`: initializers and tensor attributes, subgraphs included."""
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


def _external(tensor) -> dict:
    return {entry.key: entry.value for entry in tensor.external_data}


def is_external(tensor) -> bool:
    from onnx import TensorProto

    return tensor.HasField("data_location") and tensor.data_location == TensorProto.EXTERNAL


def load_graph(path: Path, weights: bool = True):
    """The ModelProto at `path`; `weights=False`: its structure only, each external tensor still pointing into
    the files beside `path` (read one with `tensor_array(tensor, path.parent)`)."""
    import onnx

    return onnx.load(str(path), load_external_data=weights)


def tensor_bytes(tensor, base: Path | None) -> bytes:
    """The stored bytes of one tensor: its raw data, or its range of the external file under `base`."""
    if not is_external(tensor):
        if tensor.HasField("raw_data"):
            return tensor.raw_data
        from onnx import numpy_helper

        return numpy_helper.to_array(tensor).tobytes()
    entry = _external(tensor)
    if base is None:
        raise ValueError(f"tensor {tensor.name} is external data, and no folder to read it from was given")
    with open(Path(base) / entry["location"], "rb") as handle:
        handle.seek(int(entry.get("offset", 0)))
        length = entry.get("length")
        return handle.read(int(length)) if length is not None else handle.read()


def tensor_array(tensor, base: Path | None = None) -> np.ndarray:
    """A tensor's values (one tensor read into memory, never the graph's other weights)."""
    from onnx import helper, numpy_helper

    if not is_external(tensor):
        return numpy_helper.to_array(tensor)
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    data = tensor_bytes(tensor, base)
    return np.frombuffer(data, dtype=dtype).reshape(tuple(tensor.dims)).copy()


def save_graph(model, path: Path, base: Path | None = None) -> Path | None:
    """Write `model` to `path` with every tensor of WEIGHT_BYTES or more in `<path>.data`; tensors already external
    are read from their files under `base` (default: `path`'s folder), one at a time. The model is left as it was.
    Returns the data file (None when no tensor is that large). Works in place: the data file is written beside
    and replaces the old one only once complete."""
    path = Path(path)
    base = path.parent if base is None else Path(base)
    final = data_path(path)
    staged = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}")
    moved, offset = [], 0  # (tensor, what it held), restored after the structure is written
    try:
        with open(staged, "wb") as out:
            for tensor in _tensors(model):
                size = _stored_size(tensor)
                if size < WEIGHT_BYTES and not is_external(tensor):
                    continue
                data = tensor_bytes(tensor, base)
                offset += -offset % (PAGE if len(data) >= PAGE else 64)
                out.seek(offset)
                out.write(data)
                moved.append((tensor, _detach(tensor, final.name, offset, len(data))))
                offset += len(data)
        save_structure(model, path)
    finally:
        for tensor, held in moved:
            _restore(tensor, held)
    if moved:
        os.replace(staged, final)
        final.chmod(0o644)
        return final
    staged.unlink(missing_ok=True)
    final.unlink(missing_ok=True)
    return None


def _stored_size(tensor) -> int:
    if is_external(tensor):
        return int(_external(tensor).get("length", 0))
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    from onnx import helper

    count = int(np.prod(tensor.dims)) if len(tensor.dims) else 1
    try:
        return count * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError):
        return 0  # strings: kept in the structure


def _detach(tensor, location: str, offset: int, length: int) -> tuple:
    """Point `tensor` at (location, offset, length); return what it held before, for `_restore`."""
    from onnx import TensorProto

    held: tuple
    if is_external(tensor):
        held = ("external", [(e.key, e.value) for e in tensor.external_data])
    elif tensor.HasField("raw_data"):
        held = ("raw", tensor.raw_data, tensor.HasField("data_location"))
    else:  # values in typed fields (helper.make_tensor's lists): small in practice, kept as the message
        held = ("message", tensor.SerializeToString())
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        tensor.ClearField(field)
    _set_external(tensor, [("location", location), ("offset", str(offset)), ("length", str(length))])
    tensor.data_location = TensorProto.EXTERNAL
    return held


def _set_external(tensor, entries) -> None:
    del tensor.external_data[:]
    for key, value in entries:
        tensor.external_data.add(key=key, value=value)


def _restore(tensor, held: tuple) -> None:
    kind, payload = held[:2]
    if kind == "external":
        _set_external(tensor, payload)
    elif kind == "message":
        tensor.Clear()
        tensor.ParseFromString(payload)
    else:
        del tensor.external_data[:]
        tensor.ClearField("data_location")
        if held[2]:
            tensor.data_location = 0  # DEFAULT, as it was set
        tensor.raw_data = payload


def save_structure(model, path: Path) -> None:
    """Serialize `model` to `path` as it is, its external tensors pointing where they already point (files beside
    `path`), refusing a message past the limit: for a rewrite of a graph's nodes that leaves its weights as they
    are, and the structure save_graph writes."""
    size = model.ByteSize()
    if size > proto_limit():
        big = sorted(((_stored_size(t), t.name) for t in _tensors(model) if not is_external(t)), reverse=True)[:3]
        raise TrtServeError(f"the graph's structure is {size:,} bytes without its external weights, past the "
                            f"{proto_limit():,}-byte limit of one protobuf message (largest inline tensors: "
                            f"{', '.join(f'{n} {s:,} B' for s, n in big)}); this is a bug in trtserve")
    with open(path, "wb") as handle:
        handle.write(model.SerializeToString())


def copy_graph(source: Path, target: Path) -> None:
    """Copy a graph and its weight files (one data file, named after the target)."""
    source, target = Path(source), Path(target)
    model = load_graph(source, weights=False)
    locations = {_external(t)["location"] for t in _tensors(model) if is_external(t)}
    if locations <= {data_path(source).name}:
        if locations:
            shutil.copyfile(data_path(source), data_path(target))
            for tensor in _tensors(model):
                if is_external(tensor):
                    _set_location(tensor, data_path(target).name)
        save_structure(model, target)
        return
    save_graph(model, target, base=source.parent)


def move_graph(source: Path, target: Path) -> None:
    """Rename a graph and its one data file (to the target's data file name), in the same folder."""
    source, target = Path(source), Path(target)
    model = load_graph(source, weights=False)
    external = [t for t in _tensors(model) if is_external(t)]
    if {_external(t)["location"] for t in external} - {data_path(source).name}:
        raise ValueError(f"{source} reads weight files other than {data_path(source).name}")
    if external:
        os.replace(data_path(source), data_path(target))
        for tensor in external:
            _set_location(tensor, data_path(target).name)
    save_structure(model, target)
    if source != target:
        source.unlink()


def _set_location(tensor, location: str) -> None:
    _set_external(tensor, [(e.key, location if e.key == "location" else e.value) for e in tensor.external_data])


def graph_files(path: Path) -> list[Path]:
    """`path` and the weight files its tensors read."""
    path = Path(path)
    model = load_graph(path, weights=False)
    names = sorted({_external(t)["location"] for t in _tensors(model) if is_external(t)})
    return [path] + [path.parent / name for name in names]


def graph_bytes(path: Path) -> int:
    """A graph's size on disk, its weight files included."""
    return sum(p.stat().st_size for p in graph_files(path))


@contextmanager
def graph_on_disk(model, base: Path | None = None, prefix: str = "trtserve-graph-"):
    """A path to `model` written (with its weights external) in a temp folder, removed afterwards: for an ONNX
    Runtime session of an in-memory graph of any size (a session from bytes would serialize it whole)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        path = Path(scratch) / "model.onnx"
        save_graph(model, path, base=base)
        yield path

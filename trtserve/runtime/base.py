"""The Backend protocol and the feed checks every backend shares."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from trtserve.errors import InputError, TrtServeError

if TYPE_CHECKING:
    from trtserve.engine_dir import EngineDir
    from trtserve.engine_dir.manifest import Manifest, Range, Shapes, Tensor


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32", ...
    shape: tuple[int | str, ...]  # ints for fixed axes, names ("batch", "sequence", ...) for dynamic ones

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        """From the manifest's io entry (engine_dir.manifest.Tensor)."""
        return cls(tensor.name, tensor.dtype, tuple(tensor.shape))


@dataclass(frozen=True)
class Abilities:
    """What a backend can do beyond `infer`, declared by the backend (never probed for)."""

    kv_slots: bool = False  # `kv_slots(n)`: sequence slots (the engine's in-place decode graph, or a track
    # engine's ranks), at most n; the slot batcher drives them
    processes: bool = False  # it runs helper processes of its own (`processes`: their pids), which whoever
    # supervises its owner kills with it


class Backend(Protocol):
    name: str
    engine: EngineDir
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    abilities: Abilities

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class SlotBackend(Backend, Protocol):
    """A backend whose abilities include `kv_slots`."""

    def kv_slots(self, slots: int) -> Any:
        """Its sequence slots, at most `slots` (runtime.kv_slots.KVSlots, a track engine's TrackSlots)."""


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def io_specs(manifest: Manifest) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    io = manifest.io
    assert io is not None
    return tuple(map(TensorSpec.of, io.inputs)), tuple(map(TensorSpec.of, io.outputs))


def check_feeds(feeds: Mapping[str, np.ndarray], specs: tuple[TensorSpec, ...],
                shapes: Shapes | None) -> dict[str, int]:
    """Check names, dtypes, ranks and axis ranges (the manifest's `shapes`); return the value bound to each
    named axis."""
    assert shapes is not None
    ranges = shapes.axes()
    expected = {spec.name for spec in specs}
    missing, extra = expected - set(feeds), set(feeds) - expected
    if missing or extra:
        raise InputError(f"feeds do not match the engine inputs: missing {sorted(missing)}, unexpected {sorted(extra)}")
    bound: dict[str, int] = {}
    for spec in specs:
        array = feeds[spec.name]
        if array.dtype != np.dtype(spec.dtype):
            raise InputError(f"input {spec.name} has dtype {array.dtype}, the engine expects {spec.dtype}")
        if array.ndim != len(spec.shape):
            raise InputError(f"input {spec.name} has shape {array.shape}, the engine expects rank {len(spec.shape)}")
        for size, axis in zip(array.shape, spec.shape):
            _bind_axis(spec.name, axis, size, bound, ranges)
    if {"total_sequence", "past_sequence", "sequence"} <= bound.keys():
        if bound["total_sequence"] != bound["past_sequence"] + bound["sequence"]:
            raise InputError(
                f"attention_mask covers {bound['total_sequence']} positions but past ({bound['past_sequence']}) + "
                f"new tokens ({bound['sequence']}) = {bound['past_sequence'] + bound['sequence']}"
            )
    return bound


def _bind_axis(name: str, axis: int | str, size: int, bound: dict[str, int], ranges: dict[str, Range]) -> None:
    if isinstance(axis, int):
        if size != axis:
            raise InputError(f"input {name} has size {size} on an axis fixed at {axis}")
        return
    if axis in bound and bound[axis] != size:
        raise InputError(f"axis {axis} is {bound[axis]} in one input and {size} in {name}")
    bound[axis] = size
    limits = ranges.get(axis)
    if limits and not limits.min <= size <= limits.max:
        raise InputError(
            f"input {name}: {axis}={size} is outside the engine's range [{limits.min}, {limits.max}]; "
            f"rebuild with a larger --max-{'batch' if axis == 'batch' else 'seq'} to allow it"
        )


class BackendLost(TrtServeError):
    """A backend's helper processes failed or missed their deadline: every sequence it held is gone, and the
    worker that owns it must be started afresh (its batcher re-raises this instead of ending one call's
    sequences)."""

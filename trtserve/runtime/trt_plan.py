"""What the TensorRT runtime decides without touching CUDA: whether a plan may be loaded on this
machine, which optimization profile a batch uses, and how large each device buffer must be."""

from __future__ import annotations

import math

from trtserve.errors import EngineDirError, InputError
from trtserve.runtime.devices import RTX_COMPUTE_CAPABILITIES

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


def refuse_reason(entry, flavour: str | None, version: str | None, devices: list[dict],
                  rebuild: str) -> str | None:
    """Why this plan (the manifest's `tensorrt` entry) must not be handed to TensorRT here (None: it may
    be). Checked before deserialization, because TensorRT's own refusal is an opaque error or a crash."""
    again = f"rebuild it here with `{rebuild} --backend tensorrt`, or serve the ONNX Runtime graph"
    if flavour is None:
        return f"TensorRT is not installed: {again}"
    if flavour != entry.flavour:
        return f"the plan was built with {entry.flavour}, this machine has {flavour}: {again}"
    if version != entry.version:
        newer = _version_tuple(version) > _version_tuple(entry.version)
        if not (entry.version_compatible and newer):
            return f"the plan was built with {entry.flavour} {entry.version}, this machine has {version}: {again}"
    if not devices:
        return f"a TensorRT plan needs a GPU and this machine has none: {again}"
    target = entry.compute_capability
    have = [d["compute_capability"] for d in devices]
    if target.startswith("portable"):
        allowed: tuple[str, ...] = RTX_COMPUTE_CAPABILITIES
    elif target.startswith("hardware compatibility ampere_plus"):
        allowed = tuple(cc for cc in have if _version_tuple(cc) >= (8, 0))
    elif target.startswith("sm"):
        allowed = tuple(f"{t[2:-1]}.{t[-1]}" for t in target.split(","))
    else:
        return None  # a target this version does not record precisely: let TensorRT decide
    if have[0] not in allowed:
        return (f"the plan targets {target}; GPU 0 ({devices[0]['name']}) has compute capability {have[0]}: "
                f"{again}")
    return None


def check_loadable(entry, flavour: str | None, version: str | None, devices: list[dict], rebuild: str) -> None:
    reason = refuse_reason(entry, flavour, version, devices, rebuild)
    if reason:
        raise EngineDirError(reason)


def _version_tuple(version: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in (version or "0").split(".") if p.isdigit())


def select_profile(profiles: list, bound: dict[str, int]) -> int:
    """The profile for a batch whose named axes are `bound`: single-token steps with a past go to
    the decode profile, everything else to the first profile whose ranges hold every axis."""
    order = list(range(len(profiles)))
    if bound.get("sequence") == 1 and bound.get("past_sequence", 0) > 0:
        order.sort(key=lambda i: profiles[i].name != "decode")
    for i in order:
        ranges = profiles[i].ranges
        if all(ranges[axis].min <= size <= ranges[axis].max for axis, size in bound.items() if axis in ranges):
            return i
    raise InputError(f"no optimization profile of this plan holds {bound}: "
                     + "; ".join(f"{p.name}: { {a: r.model_dump() for a, r in p.ranges.items()} }" for p in profiles))


def buffer_elements(shape: list | tuple, profiles: list) -> int:
    """Elements of the largest tensor of this (symbolic) shape under any profile."""
    largest = 0
    for profile in profiles:
        largest = max(largest, math.prod(d if isinstance(d, int) else profile.ranges[d].max for d in shape))
    return largest


def buffer_plan(io, profiles: list) -> dict[str, tuple[str, int]]:
    """{tensor name: (dtype, elements)} for one device buffer per input and output (the manifest's io),
    sized so that every shape any profile admits fits; the contexts share them (one batch runs at a time)."""
    return {spec.name: (spec.dtype, buffer_elements(spec.shape, profiles)) for spec in (*io.inputs, *io.outputs)}


def buffer_bytes(plan: dict[str, tuple[str, int]]) -> int:
    return sum(ITEMSIZE[dtype] * n for dtype, n in plan.values())

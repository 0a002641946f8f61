"""A checkpoint's sampling defaults: the fields of its generation_config.json that vLLM's
`--generation-config auto` takes (temperature, top_p, top_k, min_p, repetition_penalty), for what a
request leaves out. Checked with the request fields' own ranges; a file that breaks them is refused
naming the field, so a server never samples with a value no request could ask for."""

from __future__ import annotations

import json
from pathlib import Path

from trtserve.errors import EngineDirError

FILE = "generation_config.json"
# field -> (type, check, the range in words)
RANGES = {
    "temperature": (float, lambda v: 0.0 <= v <= 2.0, "in [0, 2]"),
    "top_p": (float, lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": (int, lambda v: v >= -1, "-1, 0 (off) or more"),
    "min_p": (float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "repetition_penalty": (float, lambda v: 0.0 < v <= 100.0, "in (0, 100]"),
}


def generation_defaults(engine_path) -> dict:
    """The sampling defaults in `engine_path`'s generation_config.json ({} without the file or the fields)."""
    path = Path(engine_path) / FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EngineDirError(f"{path} is not readable JSON ({exc}): fix it, or serve with --generation-config "
                             "none") from None
    found = {}
    for name, (kind, ok, words) in RANGES.items():
        value = data.get(name) if isinstance(data, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)) \
                or not ok(kind(value)):
            raise EngineDirError(f"{path}: {name} is {value!r}; a sampling default must be {words}. Fix the file, "
                                 "or serve with --generation-config none")
        found[name] = kind(value)
    return found

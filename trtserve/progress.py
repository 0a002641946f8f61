"""Progress lines for long steps, printed to stderr so stdout stays machine-readable."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def say(message: str) -> None:
    if not _quiet:
        print(message, file=sys.stderr, flush=True)


@contextmanager
def step(label: str):
    """Print `label ...` before a long step and its duration after it."""
    say(f"{label} ...")
    start = time.perf_counter()
    yield
    say(f"{label}: done in {time.perf_counter() - start:.1f}s")

"""Memory a process has freed, handed back to the system."""

from __future__ import annotations


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc otherwise keeps part of a released model's pages)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim
        pass

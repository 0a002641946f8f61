"""Heartbeats of helper processes: a thread of the process writes CLOCK_MONOTONIC (one clock for every
process of the machine) into shared memory once a second, busy or idle; whoever supervises the process
reads how long it has been silent. A long call in native code (which releases the interpreter) keeps
beating, so only a stopped or wedged process falls silent."""

from __future__ import annotations

import threading
import time

EVERY = 1.0  # seconds between beats


def new_heartbeat(ctx):
    """Shared memory for one process's beats, made with a multiprocessing context (one writer: a float
    store is atomic enough, so no lock)."""
    return ctx.Value("d", time.monotonic(), lock=False)


def start_beating(heartbeat) -> None:
    """In the process that beats: the beating thread."""
    def beat():
        while True:
            heartbeat.value = time.monotonic()
            time.sleep(EVERY)

    threading.Thread(target=beat, name="trtserve-heartbeat", daemon=True).start()


def silent_for(heartbeat) -> float:
    """Seconds since the last beat."""
    return time.monotonic() - heartbeat.value

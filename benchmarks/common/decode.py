"""trtserve's decode as the benchmarks run it: an engine on the batcher its server runs, and decode-step timing on
the slot batcher's KV slots."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


class Ours:
    def __init__(self, engine: Path, threads: int):
        from trtserve.runtime import load_backend
        from trtserve.runtime.text import TextEngine

        self.text = TextEngine(load_backend(engine, threads=threads))

    def run(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        """(seconds from the first token to the last, greedy token ids)."""
        from trtserve.runtime.sampling import SamplingParams
        from trtserve.runtime.slot_batching import make_batcher

        batcher = make_batcher(self.text.backend, self.text.eos_ids, 1)  # what the server runs for this engine
        batcher.add("s", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        out, first = [], None
        while batcher.has_work():
            for event in batcher.step():
                if event.token >= 0:
                    out.append(int(event.token))
                    first = first or time.perf_counter()
        return time.perf_counter() - first, out

    def run_many(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        """(seconds from the start to the last token, each sequence's greedy ids): every prompt at once on the
        batcher the server runs, with the server's default prefill chunk."""
        from trtserve.runtime.sampling import SamplingParams
        from trtserve.runtime.slot_batching import make_batcher
        from trtserve.server.config import ServerConfig

        started = time.perf_counter()
        batcher = make_batcher(self.text.backend, self.text.eos_ids, len(prompts), 1 << 20, self.text.pad_id,
                               ServerConfig.model_fields["max_prefill_tokens"].default)
        for i, prompt in enumerate(prompts):
            batcher.add(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        out = [[] for _ in prompts]
        while batcher.has_work():
            for event in batcher.step():
                if event.token >= 0:
                    out[int(event.id)].append(int(event.token))
        return time.perf_counter() - started, out


def slot_steps(slots, past: int, steps: int, rng, outside: list | None = None) -> list[float]:
    """Step times; `outside` gets each step's time outside ONNX Runtime's run (the Python around the call)."""
    slots.clear(0)
    slots.run(0, rng.integers(0, 1000, (1, past)), np.array([past]), np.array([[past - 1]]))
    times, inside = [], []
    session_run = slots.session.run_with_iobinding

    def timed_run(binding):
        started = time.perf_counter()
        session_run(binding)
        inside.append(time.perf_counter() - started)

    slots.session.run_with_iobinding = timed_run
    try:
        for _ in range(steps):
            started = time.perf_counter()
            slots.run(0, np.array([[42]]), np.array([1]), np.zeros((1, 1), np.int64))
            times.append(time.perf_counter() - started)
    finally:
        del slots.session.run_with_iobinding  # the session's own method again
    if outside is not None:
        outside.extend(t - i for t, i in zip(times, inside))
    return times

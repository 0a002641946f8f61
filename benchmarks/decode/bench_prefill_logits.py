"""Prefill with the LM head on every position against the last position only, same engine, same
real-text token ids, interleaved rounds, medians (the decoder graph's `logit_positions` input).

    .venv/bin/python -m benchmarks.decode.bench_prefill_logits [--engine engines/smollm2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def main() -> None:
    from trtserve.data.corpus import wiki_text
    from trtserve.runtime import generate, load_backend
    from trtserve.runtime.text import TextEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, default=Path("engines/smollm2"))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    backend = load_backend(args.engine)
    ids_all = TextEngine(backend).tokenize([wiki_text(3000)], add_special_tokens=False)[0]
    print(f"{args.engine}, {backend.name}; median of {args.rounds} interleaved rounds")
    print("| batch x prompt | every position | last position | speedup | logits bytes (every / last) |")
    print("|---|---|---|---|---|")
    for batch, length in ((1, 128), (16, 128), (1, 1024)):
        ids = np.array([ids_all[i * length:(i + 1) * length] for i in range(batch)], np.int64)
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for last in (False, True):
                started = time.perf_counter()
                logits = generate.step(backend, generate.start(backend, batch), ids, last_only=last)
                times[last].append(time.perf_counter() - started)
        every, last = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {batch} x {length} | {every * 1e3:.1f} ms | {last * 1e3:.1f} ms | {every / last:.2f}x | "
              f"{batch * length * logits.shape[-1] * 4 / 1e6:.1f} MB / {batch * logits.shape[-1] * 4 / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()

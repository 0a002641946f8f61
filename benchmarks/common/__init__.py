"""What the benchmarks share: the repository's root and the median of timed calls. Run every benchmark from the
repository's root as a module (`.venv/bin/python -m benchmarks.serving.bench_serving ...`); it imports trtserve as
an installed package and this folder's shared modules, nothing else of the repository."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def timed(fn, seconds: float, min_runs: int = 5, warmup: int = 3) -> float:
    """Median latency in ms of fn() over at least min_runs runs and about `seconds` seconds."""
    for _ in range(warmup):
        fn()
    samples, start = [], time.perf_counter()
    while len(samples) < min_runs or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def rss_mb(pid: int) -> float:
    line = next(row for row in Path(f"/proc/{pid}/status").read_text().splitlines() if row.startswith("VmRSS"))
    return int(line.split()[1]) / 1024

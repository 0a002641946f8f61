"""Embeddings over HTTP: throughput at concurrency 1, 8, 32 with dynamic batching on and off
(--max-batch 1), and the HTTP overhead (end-to-end p50 minus backend p50), in one run.

    .venv/bin/python -m benchmarks.serving.bench_server [--engine engines/minilm] [--seconds 5]

Requests carry one real Wikipedia sentence each (first 32 words of consecutive paragraphs).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from trtserve.testing.server import start_server, stop_server


def texts(n: int) -> list[str]:
    from trtserve.data.corpus import wiki_paragraphs

    return [" ".join(p.split()[:32]) for p in wiki_paragraphs()[:n]]


def load(url: str, concurrency: int, seconds: float, sentences: list[str]) -> tuple[float, float]:
    """(requests per second, p50 latency ms) with `concurrency` clients for `seconds`."""
    stop = time.perf_counter() + seconds
    latencies: list[float] = []

    def client(worker: int) -> None:
        with httpx.Client(timeout=60) as http:
            i = worker
            while time.perf_counter() < stop:
                body = {"model": "all-MiniLM-L6-v2", "input": sentences[i % len(sentences)]}
                started = time.perf_counter()
                response = http.post(f"{url}/v1/embeddings", json=body)
                response.raise_for_status()
                latencies.append((time.perf_counter() - started) * 1000)
                i += concurrency

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    return len(latencies) / (time.perf_counter() - began), statistics.median(latencies)


def backend_p50(engine: Path, sentences: list[str], runs: int = 200) -> float:
    from trtserve.runtime import load_backend
    from trtserve.runtime.text import TextEngine

    text = TextEngine(load_backend(engine))
    for s in sentences[:10]:
        text.embed([s])
    samples = []
    for i in range(runs):
        started = time.perf_counter()
        text.embed([sentences[i % len(sentences)]])
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, default=Path("engines/minilm"))
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if not (args.engine / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "trtserve", "build-engine", "all-MiniLM-L6-v2",
                        "--out", str(args.engine)], check=True)
    sentences = texts(256)
    results = {}
    for label, flags in (("batching on (max-batch 32)", ["--max-batch", "32", "--max-wait-ms", "5"]),
                         ("batching off (max-batch 1)", ["--max-batch", "1"]),
                         ("off, in-process (workers 0)", ["--max-batch", "1", "--workers", "0"])):
        proc, url = start_server(args.engine, *flags, "--max-queue", "1024")
        try:
            load(url, 8, 1.0, sentences)  # warm-up
            results[label] = {c: load(url, c, args.seconds, sentences) for c in (1, 8, 32)}
        finally:
            stop_server(proc)
    base = backend_p50(args.engine, sentences)
    print("MiniLM embeddings over HTTP, one sentence per request, CPU (2 cores)")
    print(f"{'setting':<28} {'conc':>4} {'req/s':>8} {'p50 ms':>8}")
    for label, rows in results.items():
        for conc, (rps, p50) in rows.items():
            print(f"{label:<28} {conc:>4} {rps:>8.1f} {p50:>8.2f}")
    on, off = results["batching on (max-batch 32)"], results["batching off (max-batch 1)"]
    print(f"throughput ratio batching on/off at concurrency 32: {on[32][0] / off[32][0]:.2f}x")
    print(f"backend p50 (in process, batch 1): {base:.2f} ms")
    print("HTTP overhead at concurrency 1 (end-to-end p50 - backend p50): "
          + "; ".join(f"{label} {rows[1][1] - base:.2f} ms" for label, rows in results.items()))


if __name__ == "__main__":
    main()

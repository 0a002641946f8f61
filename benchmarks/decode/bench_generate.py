"""Generation speed in one run: batch-1 decode against Hugging Face `generate` (torch eager, its
own KV cache, greedy) on the same model and prompt, then total output tokens/s of the real server
at 1, 4 and 16 concurrent streams with TTFT and TPOT p50/p99.

    .venv/bin/python -m benchmarks.decode.bench_generate [--engine DIR] [--tokens 64] [--requests 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from trtserve.testing.server import start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The history of the city of Paris begins"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def hf_generate(tokens: int, runs: int = 3) -> tuple[float, float]:
    """(ms for prefill + first token, decode tokens/s after it), medians, Hugging Face generate."""
    import torch

    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve

    source = resolve(MODEL)
    model, tokenizer = load_torch_model(source, attention="eager"), load_hf_tokenizer(source.path)
    ids = tokenizer(PROMPT, return_tensors="pt")

    def run(n):
        with torch.inference_mode():
            started = time.perf_counter()
            model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return time.perf_counter() - started

    run(4)
    first = statistics.median(run(1) for _ in range(runs))
    full = statistics.median(run(tokens) for _ in range(runs))
    return first * 1000, (tokens - 1) / (full - first)


def ours(engine: Path, tokens: int, runs: int = 3) -> tuple[float, float]:
    """The same, for trtserve's continuous batcher with one sequence (in process, no HTTP)."""
    from trtserve.runtime import load_backend
    from trtserve.runtime.sampling import SamplingParams
    from trtserve.runtime.slot_batching import make_batcher
    from trtserve.runtime.text import TextEngine

    text = TextEngine(load_backend(engine))
    prompt = text.tokenize([PROMPT])[0]

    def run(n):
        batcher = make_batcher(text.backend, text.eos_ids, 1)
        batcher.add("s", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        started = time.perf_counter()
        while batcher.has_work():
            batcher.step()
        return time.perf_counter() - started

    run(4)
    first = statistics.median(run(1) for _ in range(runs))
    full = statistics.median(run(tokens) for _ in range(runs))
    return first * 1000, (tokens - 1) / (full - first)


def stream_once(url: str, tokens: int) -> tuple[float, list[float], int]:
    """(TTFT s, inter-chunk gaps s, tokens) for one streamed completion."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started, stamps, count = time.perf_counter(), [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    return stamps[0] - started, [b - a for a, b in zip(stamps, stamps[1:])], count


def load(url: str, streams: int, requests: int, tokens: int) -> dict:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda _: stream_once(url, tokens), range(streams * requests)))
    wall = time.perf_counter() - started
    ttft = [r[0] * 1000 for r in results]
    tpot = [statistics.mean(r[1]) * 1000 for r in results if r[1]]
    return {"tokens_per_s": sum(r[2] for r in results) / wall, "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99), "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, default=Path("engines/smollm2"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="streams each client runs one after another")
    args = parser.parse_args()
    if not (args.engine / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "trtserve", "build-engine", MODEL, "--out", str(args.engine)], check=True)
    hf_first, hf_rate = hf_generate(args.tokens)
    our_first, our_rate = ours(args.engine, args.tokens)
    print(f"{MODEL}, greedy, {args.tokens} new tokens, prompt {PROMPT!r}, CPU")
    print(f"{'batch 1':<32} {'prefill+1st ms':>15} {'decode tok/s':>13}")
    print(f"{'Hugging Face generate (eager)':<32} {hf_first:>15.1f} {hf_rate:>13.1f}")
    print(f"{'trtserve (ONNX Runtime)':<32} {our_first:>15.1f} {our_rate:>13.1f}")
    print(f"decode speedup at batch 1: {our_rate / hf_rate:.2f}x")
    proc, url = start_server(args.engine, "--max-num-seqs", "16")
    try:
        stream_once(url, 8)  # warm-up
        rows = {n: load(url, n, args.requests, args.tokens) for n in (1, 4, 16)}
    finally:
        stop_server(proc)
    print(f"{'concurrent streams':<20} {'output tok/s':>12} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9}")
    for n, r in rows.items():
        print(f"{n:<20} {r['tokens_per_s']:>12.1f} {r['ttft_p50']:>9.1f} {r['ttft_p99']:>9.1f} "
              f"{r['tpot_p50']:>9.1f} {r['tpot_p99']:>9.1f}")
    print(f"aggregate throughput 16 streams vs 1: {rows[16]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x "
          "(times in ms)")


if __name__ == "__main__":
    main()

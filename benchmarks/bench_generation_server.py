"""Generation over HTTP under load: time to first token, inter-token latency (p50, p99) and output
tokens per second at a fixed concurrency, for several `--max-prefill-tokens` settings in one run.

    .venv/bin/python benchmarks/bench_generation_server.py [--engine engines/smollm2] [--concurrency 32]
        [--prompt 128] [--tokens 64] [--seconds 60] [--prefill 0 256 64]

Each client streams completions back to back; every request's prompt is `--prompt` token ids of real
Wikipedia text (a different start per request, the same ids for every setting), greedy, `--tokens`
tokens with ignore_eos. Inter-token latency is the gap between successive streamed tokens of one
request; every token streamed within the window counts, of finished requests or not. After each
setting the same load runs on the worker's batcher in this process (no HTTP, no pipe), for the ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.server_process import start_server, stop_server  # noqa: E402  (same start/stop as the tests)


def prompts(engine: Path, count: int, length: int) -> list[list[int]]:
    from trtserve.models.loading import load_hf_tokenizer
    from trtserve.precision.measure import Corpus

    return Corpus.wikipedia().rows(load_hf_tokenizer(engine), count, length, special=False)


def one(http: httpx.Client, url: str, model: str, prompt: list[int], tokens: int, stop: float) -> tuple[float, list]:
    """(when the request was sent, when each streamed token arrived) of one completion; the stream is
    closed at `stop`."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started, stamps = time.perf_counter(), []
    with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if time.perf_counter() > stop:
                break
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    return started, stamps


def load(url: str, model: str, concurrency: int, seconds: float, rows: list[list[int]], tokens: int) -> dict:
    """Every token streamed within the window counts (requests still running at its end too)."""
    stop = time.perf_counter() + seconds
    ttft, itl, count, done = [], [], [0], [0]

    def client(worker: int) -> None:
        with httpx.Client(timeout=600) as http:
            i = worker
            while time.perf_counter() < stop:
                started, stamps = one(http, url, model, rows[i % len(rows)], tokens, stop)
                if stamps:
                    ttft.append(stamps[0] - started)
                    itl.extend(np.diff(stamps))
                count[0] += len(stamps)
                done[0] += len(stamps) == tokens
                i += concurrency

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    elapsed = min(time.perf_counter(), stop) - began
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else float("nan")  # noqa: E731
    return {"requests": done[0], "output_tok_s": count[0] / elapsed, "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99), "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3}


def in_process(engine: Path, concurrency: int, seconds: float, rows: list[list[int]], tokens: int, setting: int,
               max_num_seqs: int) -> float:
    """Output tok/s of the same load on the batcher the worker runs, in this process (no HTTP, no pipe):
    `concurrency` sequences in flight, a new one added as each ends."""
    from trtserve.runtime import load_backend
    from trtserve.runtime.sampling import SamplingParams
    from trtserve.runtime.slot_batching import make_batcher
    from trtserve.runtime.text import TextEngine

    text = TextEngine(load_backend(engine))
    batcher = make_batcher(text.backend, text.eos_ids, max_num_seqs, 4096, text.pad_id, setting or None)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        batcher.add(str(i), rows[i % len(rows)], params)
    added, count, stop = concurrency, 0, time.perf_counter() + seconds
    began = time.perf_counter()
    while time.perf_counter() < stop:
        for event in batcher.step():
            count += event.token >= 0
            if event.finish or event.error:
                batcher.add(str(added), rows[added % len(rows)], params)
                added += 1
    return count / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, default=Path("engines/smollm2"))
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--prefill", type=int, nargs="+", default=[0, 256, 64],
                        help="--max-prefill-tokens settings to compare (0: each prefill in one call)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()
    model = json.loads((args.engine / "manifest.json").read_text())["model"]["id"]
    rows = prompts(args.engine, 256, args.prompt)
    results = {}
    for setting in args.prefill:
        proc, url = start_server(args.engine, "--max-num-seqs", str(args.max_num_seqs), "--max-queue", "1024",
                                 "--max-prefill-tokens", str(setting), "--request-timeout", "600")
        try:
            load(url, model, 2, 5.0, rows, 8)  # warm-up
            results[setting] = load(url, model, args.concurrency, args.seconds, rows, args.tokens)
        finally:
            stop_server(proc)
        results[setting]["in_process_tok_s"] = in_process(args.engine, args.concurrency, args.seconds, rows,
                                                          args.tokens, setting, args.max_num_seqs)
    print(f"{model} over HTTP: concurrency {args.concurrency}, {args.prompt}-token real prompts, {args.tokens} "
          f"tokens, {args.seconds:.0f} s per setting, --max-num-seqs {args.max_num_seqs}")
    print("| --max-prefill-tokens | requests finished | output tok/s | in process | HTTP / in process | TTFT p50 "
          "| TTFT p99 | ITL p50 | ITL p99 | p99/p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for setting, r in results.items():
        print(f"| {setting or 'whole prefill'} | {r['requests']} | {r['output_tok_s']:.1f} | {r['in_process_tok_s']:.1f} "
              f"| {r['output_tok_s'] / r['in_process_tok_s']:.0%} | {r['ttft_p50_s']:.2f} s "
              f"| {r['ttft_p99_s']:.2f} s | {r['itl_p50_ms']:.0f} ms | {r['itl_p99_ms']:.0f} ms "
              f"| {r['itl_p99_ms'] / r['itl_p50_ms']:.2f} |")


if __name__ == "__main__":
    main()

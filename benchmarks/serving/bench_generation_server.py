"""Generation over HTTP under load: time to first token, inter-token latency (p50, p99) and output
tokens per second at a fixed concurrency, for several `--max-prefill-tokens` settings in one run.

    .venv/bin/python -m benchmarks.serving.bench_generation_server [--engine engines/smollm2] [--concurrency 32]
        [--prompt 128] [--tokens 64] [--seconds 60] [--prefill 0 256 64] [--in-process-only]

Each client streams completions back to back; every request's prompt is `--prompt` token ids of real
Wikipedia text (a different start per request, the same ids for every setting), greedy, `--tokens`
tokens with ignore_eos. Inter-token latency is the gap between successive streamed tokens of one
request; every token streamed within the window counts, of finished requests or not. After each
setting the same load runs on the worker's batcher in this process (no HTTP, no pipe), for the ratio; its
latencies are taken as the batcher hands the tokens out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import numpy as np

from trtserve.testing.server import start_server, stop_server


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
    stamps: dict[int, list[float]] = {}
    done = [0]

    def client(worker: int) -> None:
        with httpx.Client(timeout=600) as http:
            i = worker
            while time.perf_counter() < stop:
                started, streamed = one(http, url, model, rows[i % len(rows)], tokens, stop)
                stamps[i] = [started] + streamed
                done[0] += len(streamed) == tokens
                i += concurrency

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    return {"requests": done[0], **_latencies(stamps, min(time.perf_counter(), stop) - began)}


def in_process(engine: Path, concurrency: int, seconds: float, rows: list[list[int]], tokens: int, setting: int,
               max_num_seqs: int) -> dict:
    """The same load on the batcher the worker runs, in this process (no HTTP, no pipe): `concurrency`
    sequences in flight, a new one added as each ends; output tok/s, and time to first token and inter-token
    latency as the batcher hands tokens out."""
    from trtserve.runtime import load_backend
    from trtserve.runtime.sampling import SamplingParams
    from trtserve.runtime.slot_batching import make_batcher
    from trtserve.runtime.text import TextEngine

    text = TextEngine(load_backend(engine))
    batcher = make_batcher(text.backend, text.eos_ids, max_num_seqs, 4096, text.pad_id, setting or None)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    stamps: dict[str, list[float]] = {}
    for i in range(concurrency):
        batcher.add(str(i), rows[i % len(rows)], params)
        stamps[str(i)] = [began]
    added, stop = concurrency, began + seconds
    while time.perf_counter() < stop:
        events = batcher.step()
        now = time.perf_counter()
        for event in events:
            if event.token >= 0:
                stamps[event.id].append(now)
            if event.finish or event.error:
                batcher.add(str(added), rows[added % len(rows)], params)
                stamps[str(added)] = [now]
                added += 1
    elapsed = time.perf_counter() - began
    return _latencies(stamps, elapsed)


def _latencies(stamps: dict[str, list[float]], elapsed: float) -> dict:
    """Output tok/s, TTFT and ITL percentiles from each sequence's [start, token, token, ...] times."""
    ttft = [s[1] - s[0] for s in stamps.values() if len(s) > 1]
    itl = [gap for s in stamps.values() for gap in np.diff(s[1:])]
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else float("nan")  # noqa: E731
    return {"output_tok_s": sum(len(s) - 1 for s in stamps.values()) / elapsed, "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99), "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3}


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
    parser.add_argument("--in-process-only", action="store_true", help="skip the HTTP server")
    args = parser.parse_args()
    model = json.loads((args.engine / "manifest.json").read_text())["model"]["id"]
    rows = prompts(args.engine, 256, args.prompt)
    results = {}
    for setting in args.prefill:
        results[setting] = {}
        if not args.in_process_only:
            proc, url = start_server(args.engine, "--max-num-seqs", str(args.max_num_seqs), "--max-queue", "1024",
                                     "--max-prefill-tokens", str(setting), "--request-timeout", "600")
            try:
                load(url, model, 2, 5.0, rows, 8)  # warm-up
                results[setting]["http"] = load(url, model, args.concurrency, args.seconds, rows, args.tokens)
            finally:
                stop_server(proc)
        results[setting]["in process"] = in_process(args.engine, args.concurrency, args.seconds, rows, args.tokens,
                                                    setting, args.max_num_seqs)
    print(f"{model}: concurrency {args.concurrency}, {args.prompt}-token real prompts, {args.tokens} "
          f"tokens, {args.seconds:.0f} s per setting, --max-num-seqs {args.max_num_seqs}")
    print("| --max-prefill-tokens | through | requests finished | output tok/s | TTFT p50 | TTFT p99 | ITL p50 "
          "| ITL p99 | p99/p50 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for setting, runs in results.items():
        for through, r in runs.items():
            print(f"| {setting or 'whole prefill'} | {through} | {r.get('requests', '')} | {r['output_tok_s']:.1f} "
                  f"| {r['ttft_p50_s']:.2f} s | {r['ttft_p99_s']:.2f} s | {r['itl_p50_ms']:.0f} ms "
                  f"| {r['itl_p99_ms']:.0f} ms | {r['itl_p99_ms'] / r['itl_p50_ms']:.2f} |")
        if "http" in runs:
            print(f"|  | HTTP / in process |  | "
                  f"{runs['http']['output_tok_s'] / runs['in process']['output_tok_s']:.0%} "
                  "|  |  |  |  |  |")


if __name__ == "__main__":
    main()

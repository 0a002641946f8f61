"""Time to first token with and without automatic prefix caching: a long shared prefix, then a short
question, twice per round (the first request prefills the prefix, the second may reuse it).

    .venv/bin/python -m benchmarks.serving.bench_prefix_cache [--engine engines/smollm2] [--prefix 1000]
        [--question 20] [--rounds 5]

Each round takes a new prefix (real Wikipedia text, a different start per round, so the first request
of a round finds nothing cached) and two different questions (real text too); both requests stream a
completion of token ids, greedy, and the time to the first streamed token is measured. The same ids
go to a server with the cache (the default) and one without (`--prefix-cache-mib 0`), rounds taking
turns between the two servers. Medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.common import ROOT
from trtserve.testing.server import metric, start_server, stop_server


def ttft(url: str, model: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                return time.perf_counter() - started
    raise RuntimeError("no token streamed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default=str(ROOT / "engines" / "smollm2"))
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--question", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from trtserve.models.loading import load_hf_tokenizer
    from trtserve.precision.measure import Corpus

    rows = Corpus.wikipedia().rows(load_hf_tokenizer(args.engine), 3 * args.rounds, args.prefix, special=False)
    rounds = [(rows[3 * r], rows[3 * r + 1][:args.question], rows[3 * r + 2][:args.question])
              for r in range(args.rounds)]
    model = json.loads((Path(args.engine) / "manifest.json").read_text())["model"]["id"]
    servers = {"cache": start_server(args.engine), "no cache": start_server(args.engine, "--prefix-cache-mib", "0")}
    times = {name: ([], []) for name in servers}
    try:
        for _, url in servers.values():  # warm-up: the first request of a server pays one-off costs
            ttft(url, model, rows[0][:32])
        for prefix, first, second in rounds:
            for name, (_, url) in servers.items():
                times[name][0].append(ttft(url, model, prefix + first))
                times[name][1].append(ttft(url, model, prefix + second))
        hits = {name: metric(url, "trtserve_prefix_cache_hits_total") for name, (_, url) in servers.items()}
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(f"{args.engine}: {args.prefix}-token shared prefix + {args.question}-token question, "
          f"{args.rounds} rounds, medians")
    print("| server | first request TTFT | second request TTFT | second / first | prefix tokens reused |")
    print("|---|---|---|---|---|")
    for name, (a, b) in times.items():
        first, second = statistics.median(a), statistics.median(b)
        print(f"| {name} | {first * 1000:.0f} ms | {second * 1000:.0f} ms | {second / first:.1%} | {hits[name]:.0f} |")


if __name__ == "__main__":
    main()

"""Batch-1 decode side by side: trtserve engines (one per precision) and, where installed, llama.cpp on
the GGUF file the checkpoint came from. Same 128-token real-text prompt ids for every engine, 64 greedy
tokens, engines taking turns (order reversed every other round), medians; greedy tokens compared
with the first engine's.

    .venv/bin/python -m benchmarks.decode.bench_decode --engine fp32=engines/smollm2 --engine gguf=engines/smollm2-gguf
        [--llama-cpp] [--ort-genai fp32=DIR ...] [--rounds 7] [--prompt 128] [--tokens 64] [--threads 2]
        [--sequences 16]

With --sequences N, N prompts (different real text, one length) run at once, end to end: trtserve on the
batcher its server runs, ONNX Runtime GenAI as one batch of its greedy search (llama.cpp's batching is
measured as a server instead, in benchmarks/serving/bench_serving.py).

The peers are not dependencies: `--llama-cpp` needs `llama_cpp` (llama-cpp-python, benchmarks/peers/setup_llama_cpp.sh)
importable, `--ort-genai` needs `onnxruntime_genai` and a model its builder wrote (benchmarks/peers/setup_ort_genai.sh).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.common.decode import Ours
from benchmarks.common.peers import LlamaCpp, OrtGenAI


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading greedy tokens two engines share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    from trtserve.data.corpus import wiki_text
    from trtserve.runtime.text import TextEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=DIR", required=True)
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp on the engines' GGUF source")
    parser.add_argument("--ort-genai", action="append", default=[], metavar="NAME=DIR",
                        help="add ONNX Runtime GenAI on a model dir from benchmarks/peers/setup_ort_genai.sh")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=1,
                        help="above 1: that many prompts at once (different real text, one length), end to end")
    args = parser.parse_args()
    engines = {}
    for item in args.engine:
        name, _, path = item.partition("=")
        engines[name] = Ours(Path(path), args.threads)
    first = next(iter(engines.values()))
    prompt = TextEngine(first.text.backend).tokenize([wiki_text(4000)], add_special_tokens=False)[0][:args.prompt]
    if args.llama_cpp:
        from trtserve.models.sources import resolve

        gguf = resolve(first.text.backend.engine.manifest.model.source).gguf
        engines[f"llama.cpp {gguf.name}"] = LlamaCpp(gguf, args.threads)
    for item in args.ort_genai:
        name, _, path = item.partition("=")
        engines[f"ORT GenAI {name}"] = OrtGenAI(Path(path), args.threads)
    if args.sequences > 1:
        return many(engines, first, args)
    for engine in engines.values():
        engine.run(prompt, 8)  # warm-up
    times = {name: [] for name in engines}
    tokens = {}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            seconds, tokens[name] = engines[name].run(prompt, args.tokens)
            times[name].append(seconds)
    base = next(iter(engines))
    rate = {name: (args.tokens - 1) / statistics.median(t) for name, t in times.items()}
    print(f"batch 1, {args.prompt}-token real prompt, {args.tokens} greedy tokens, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds")
    print(f"| engine | decode tok/s | vs {base} | greedy tokens equal to {base}'s |")
    print("|---|---|---|---|")
    for name in engines:
        print(f"| {name} | {rate[name]:.1f} | {rate[name] / rate[base]:.2f}x | "
              f"first {agreement(tokens[base], tokens[name])} of {args.tokens} |")


def many(engines: dict, first: Ours, args) -> None:
    """`args.sequences` prompts at once, end to end (prefill included): generated tok/s."""
    from trtserve.models.loading import load_hf_tokenizer
    from trtserve.precision.measure import Corpus

    if any(isinstance(e, LlamaCpp) for e in engines.values()):
        raise SystemExit("--llama-cpp runs one sequence; llama.cpp's batching is measured as a server "
                         "(benchmarks/serving/bench_serving.py --llama-server)")
    tokenizer = load_hf_tokenizer(first.text.backend.engine.path)
    prompts = Corpus.wikipedia().rows(tokenizer, args.sequences, args.prompt, special=False)
    for engine in engines.values():
        engine.run_many(prompts[:2], 4)  # warm-up
    times, tokens = {name: [] for name in engines}, {}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            seconds, tokens[name] = engines[name].run_many(prompts, args.tokens)
            times[name].append(seconds)
    base = next(iter(engines))
    rate = {name: args.sequences * args.tokens / statistics.median(t) for name, t in times.items()}
    print(f"{args.sequences} sequences at once, {args.prompt}-token real prompts, {args.tokens} greedy tokens each, "
          f"{args.threads} threads, end to end (prefill included), median of {args.rounds} interleaved rounds")
    print(f"| engine | generated tok/s | vs {base} | sequences with {base}'s greedy tokens, all {args.tokens} |")
    print("|---|---|---|---|")
    for name in engines:
        same = sum(a == b for a, b in zip(tokens[base], tokens[name]))
        print(f"| {name} | {rate[name]:.1f} | {rate[name] / rate[base]:.2f}x | {same} of {args.sequences} |")


if __name__ == "__main__":
    main()

"""Batch-1 decode side by side: trtserve engines (one per precision) and, where installed, llama.cpp on
the GGUF file the checkpoint came from. Same 128-token real-text prompt ids for every engine, 64 greedy
tokens, engines taking turns (order reversed every other round), medians; greedy tokens compared
with the first engine's.

    .venv/bin/python benchmarks/bench_decode.py --engine fp32=engines/smollm2 --engine gguf=engines/smollm2-gguf
        [--llama-cpp] [--ort-genai fp32=DIR ...] [--rounds 7] [--prompt 128] [--tokens 64] [--threads 2]
        [--sequences 16]

With --sequences N, N prompts (different real text, one length) run at once, end to end: trtserve on the
batcher its server runs, ONNX Runtime GenAI as one batch of its greedy search (llama.cpp's batching is
measured as a server instead, in benchmarks/bench_serving.py).

The peers are not dependencies: `--llama-cpp` needs `llama_cpp` (llama-cpp-python, benchmarks/setup_llama_cpp.sh)
importable, `--ort-genai` needs `onnxruntime_genai` and a model its builder wrote (benchmarks/setup_ort_genai.sh).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int, n_ctx: int = 1024, logits_all: bool = False):
        from llama_cpp import Llama

        # the AMX buffer types crash on some VMs; the plain CPU path is what a default build runs elsewhere
        self.llm = Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False, use_extra_bufts=False,
                         logits_all=logits_all)

    def logits(self, ids: list[int]) -> np.ndarray:
        """(S, V) next-token logits of every position (needs `logits_all`)."""
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[:len(ids)], np.float32)

    def run(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        self.llm.reset()
        out, first = [], None
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            first = first or time.perf_counter()
            if len(out) == tokens:
                break
        return time.perf_counter() - first, out


class OrtGenAI:
    """ONNX Runtime GenAI on a model its builder wrote (benchmarks/setup_ort_genai.sh): its own decode loop,
    KV buffer shared by past and present, greedy search."""

    def __init__(self, model_dir: Path, threads: int):
        import json

        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def run(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + tokens, min_length=len(prompt) + tokens, do_sample=False)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(prompt)  # the prompt's forward pass
        out, first = [], None
        while len(out) < tokens and not generator.is_done():
            generator.generate_next_token()  # the first picks from the prompt's logits, later ones run a step
            out.append(int(generator.get_next_tokens()[0]))
            first = first or time.perf_counter()
        return time.perf_counter() - first, out

    def run_many(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        """The prompts (all of one length) as one batch of its greedy search."""
        started = time.perf_counter()
        params = self.og.GeneratorParams(self.model)
        length = len(prompts[0]) + tokens
        params.set_search_options(batch_size=len(prompts), max_length=length, min_length=length, do_sample=False)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.array(prompts, np.int32))
        out = [[] for _ in prompts]
        while len(out[0]) < tokens and not generator.is_done():
            generator.generate_next_token()
            for row, token in enumerate(np.asarray(generator.get_next_tokens()).ravel()):
                out[row].append(int(token))
        return time.perf_counter() - started, out

    def logits(self, ids: list[int]) -> np.ndarray:
        """(S, V) next-token logits of every position of one prompt pass."""
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + 1)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(ids)
        return np.asarray(generator.get_output("logits"))[0]


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
                        help="add ONNX Runtime GenAI on a model dir from benchmarks/setup_ort_genai.sh")
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
                         "(benchmarks/bench_serving.py --llama-server)")
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

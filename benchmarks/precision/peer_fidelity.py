"""The fidelity of what a peer computes, measured as trtserve's build gate measures its own engines: next-token
top-1 agreement and perplexity against the fp32 engine (equal to torch fp32 within 1e-6) on the bundled
Wikipedia sample, in windows of real text (four of 128 tokens, one of 512 and one of 1,024), every position.

    .venv/bin/python -m benchmarks.precision.peer_fidelity --engine engines/smollm2 [--llama-cpp]
        [--ort-genai int4=DIR ...] [--engine-under-test gguf=engines/smollm2-gguf ...]

The peers are the ones of benchmarks/decode/bench_decode.py (installed by benchmarks/peers/setup_llama_cpp.sh and
benchmarks/peers/setup_ort_genai.sh); `--engine-under-test` adds trtserve engines for comparison.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

WINDOWS = ((0, 128), (128, 128), (256, 128), (384, 128), (1024, 512), (2048, 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, required=True, help="the fp32 engine: the reference")
    parser.add_argument("--engine-under-test", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--llama-cpp", action="store_true", help="llama.cpp on the engine's GGUF source")
    parser.add_argument("--ort-genai", action="append", default=[], metavar="NAME=DIR")
    args = parser.parse_args()
    from benchmarks.common.peers import LlamaCpp, OrtGenAI
    from trtserve.data.corpus import wiki_text
    from trtserve.precision.fidelity import perplexity, top1_agreement
    from trtserve.runtime import load_backend
    from trtserve.runtime.generate import start, step
    from trtserve.runtime.text import TextEngine

    def engine_logits(backend, window: list[int]) -> np.ndarray:
        return step(backend, start(backend, 1), np.array([window], np.int64))[0]

    reference = TextEngine(load_backend(args.engine, threads=2))
    ids = list(reference.tokenize([wiki_text(3000)], add_special_tokens=False)[0])
    peers = {}
    for item in args.engine_under_test:
        name, _, path = item.partition("=")
        backend = load_backend(Path(path), threads=2)
        peers[f"trtserve {name}"] = lambda w, backend=backend: engine_logits(backend, w)
    if args.llama_cpp:
        from trtserve.models.sources import resolve

        gguf = resolve(reference.backend.engine.manifest.model.source).gguf
        peers[f"llama.cpp {gguf.name}"] = LlamaCpp(gguf, 2, n_ctx=2048, logits_all=True).logits
    for item in args.ort_genai:
        name, _, path = item.partition("=")
        peers[f"ORT GenAI {name}"] = OrtGenAI(Path(path), 2).logits
    print(f"against {args.engine} (fp32) on the bundled Wikipedia sample; windows of real text, every position\n")
    print("| engine | " + " | ".join(f"top-1 / ppl delta, {n} at {o}" for o, n in WINDOWS) + " | worst top-1 |")
    print("|---|" + "---|" * (len(WINDOWS) + 1))
    references = [(ids[o:o + n], engine_logits(reference.backend, ids[o:o + n])) for o, n in WINDOWS]
    for name, run in peers.items():
        cells, worst = [], 1.0
        for window, ref in references:
            out = run(window)
            top1 = top1_agreement(ref, out)
            tokens, mask = np.array([window]), np.ones((1, len(window)), np.int64)
            delta = perplexity(out[None], tokens, mask) / perplexity(ref[None], tokens, mask) - 1
            worst = min(worst, top1)
            cells.append(f"{top1:.2%} / {delta:+.2%}")
        print(f"| {name} | " + " | ".join(cells) + f" | {worst:.2%} |", flush=True)


if __name__ == "__main__":
    main()

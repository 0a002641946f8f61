"""The fidelity of what a peer computes, measured as trtserve's build gate measures its own engines: next-token
top-1 agreement and perplexity against the fp32 engine (equal to torch fp32 within 1e-6) on the bundled
Wikipedia sample, in windows of real text (four of 128 tokens, one of 512 and one of 1,024), every position.

    .venv/bin/python benchmarks/peer_fidelity.py --engine engines/smollm2 [--llama-cpp]
        [--ort-genai int4=DIR ...] [--engine-under-test gguf=engines/smollm2-gguf ...]

The peers are the ones of benchmarks/bench_decode.py (installed by benchmarks/setup_llama_cpp.sh and
benchmarks/setup_ort_genai.sh); `--engine-under-test` adds trtserve engines for comparison.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

WINDOWS = ((0, 128), (128, 128), (256, 128), (384, 128), (1024, 512), (2048, 1024))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    scores = log_softmax(logits[:-1].astype(np.float64))
    return float(np.exp(-np.mean(scores[np.arange(len(ids) - 1), ids[1:]])))


def engine_logits(backend, ids: list[int]) -> np.ndarray:
    from trtserve.runtime.generate import logit_feed, start

    n = len(ids)
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n, dtype=np.int64)[None]}
    feeds.update(logit_feed(backend, n, last_only=False))
    feeds.update(start(backend, 1).past)
    return backend.infer(feeds)["logits"][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, required=True, help="the fp32 engine: the reference")
    parser.add_argument("--engine-under-test", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--llama-cpp", action="store_true", help="llama.cpp on the engine's GGUF source")
    parser.add_argument("--ort-genai", action="append", default=[], metavar="NAME=DIR")
    args = parser.parse_args()
    from trtserve.data.corpus import wiki_text
    from trtserve.runtime import load_backend
    from trtserve.runtime.text import TextEngine

    reference = TextEngine(load_backend(args.engine, threads=2))
    ids = list(reference.tokenize([wiki_text(3000)], add_special_tokens=False)[0])
    peers = {}
    for item in args.engine_under_test:
        name, _, path = item.partition("=")
        backend = load_backend(Path(path), threads=2)
        peers[f"trtserve {name}"] = lambda w, backend=backend: engine_logits(backend, w)
    if args.llama_cpp:
        from llama_cpp import Llama

        from trtserve.models.sources import resolve

        gguf = resolve(reference.backend.engine.manifest["model"]["source"]).gguf
        llm = Llama(str(gguf), n_ctx=2048, n_threads=2, n_batch=512, logits_all=True, verbose=False,
                    use_extra_bufts=False)

        def llama(window: list[int]) -> np.ndarray:
            llm.reset()
            llm.eval(window)
            return np.array(llm.scores[:len(window)], np.float32)

        peers[f"llama.cpp {gguf.name}"] = llama
    for item in args.ort_genai:
        import onnxruntime_genai as og

        name, _, path = item.partition("=")
        model = og.Model(path)

        def genai(window: list[int], model=model) -> np.ndarray:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(window) + 1)
            generator = og.Generator(model, params)
            generator.append_tokens(window)
            return np.asarray(generator.get_output("logits"))[0]

        peers[f"ORT GenAI {name}"] = genai
    print(f"against {args.engine} (fp32) on the bundled Wikipedia sample; windows of real text, every position\n")
    print("| engine | " + " | ".join(f"top-1 / ppl delta, {n} at {o}" for o, n in WINDOWS) + " | worst top-1 |")
    print("|---|" + "---|" * (len(WINDOWS) + 1))
    references = [(ids[o:o + n], engine_logits(reference.backend, ids[o:o + n])) for o, n in WINDOWS]
    for name, run in peers.items():
        cells, worst = [], 1.0
        for window, ref in references:
            out = run(window)
            top1 = float((ref.argmax(-1) == out.argmax(-1)).mean())
            delta = perplexity(out, window) / perplexity(ref, window) - 1
            worst = min(worst, top1)
            cells.append(f"{top1:.2%} / {delta:+.2%}")
        print(f"| {name} | " + " | ".join(cells) + f" | {worst:.2%} |", flush=True)


if __name__ == "__main__":
    main()

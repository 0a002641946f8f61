"""What choosing one token costs the worker per sequence and step: trtserve's Sampler on one row of logits the
size of a vocabulary (random, with a few likely tokens, as a model's are), for the sampling settings requests
and generation configs use. Median of `--runs` calls after a warm-up.

    .venv/bin/python -m benchmarks.decode.bench_sampling [--vocab 49152] [--runs 300]
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.common import timed as median_ms

SETTINGS = {  # name -> SamplingParams fields
    "greedy (temperature 0)": {"temperature": 0.0},
    "temperature 1 (OpenAI's default)": {},
    "top-k 50": {"top_k": 50},
    "top-p 0.9": {"top_p": 0.9},
    "temperature 0.7, top-p 0.95": {"temperature": 0.7, "top_p": 0.95},
    "top-k 20, top-p 0.8": {"top_k": 20, "top_p": 0.8},
    "min-p 0.05": {"min_p": 0.05},
}


def main() -> None:
    from trtserve.runtime.sampling import Sampler, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(args.vocab) * 3).astype(np.float32)
    logits[:3] += 30  # a few likely tokens
    print(f"ms per call of Sampler.choose, {args.vocab} tokens, median of {args.runs}")
    print("| setting | ms |\n|---|---:|")
    for name, fields in SETTINGS.items():
        sampler = Sampler(SamplingParams(seed=1, **fields), args.vocab)
        print(f"| {name} | {median_ms(lambda sampler=sampler: sampler.choose(logits), 0, args.runs, warmup=10):.3f} |")


if __name__ == "__main__":
    main()

"""torch eager (Hugging Face, fp32) vs trtserve's ONNX Runtime backend, CPU latency, one run.

    .venv/bin/python -m benchmarks.encoders.bench_backends [--engines DIR] [--seconds 3]

The baseline is what a user would run instead: the checkpoint in transformers with eager
attention (its own KV cache for decode), on the same real Wikipedia text and thread count.
Each figure is the median over repeated runs after warm-up; ratios are baseline / ours.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.common import timed


def ensure_engine(name: str, out: Path) -> Path:
    from trtserve.engine_builder.build import BuildConfig, build_engine
    from trtserve.engine_dir import open_engine_dir
    from trtserve.errors import EngineDirError

    try:
        open_engine_dir(out)
    except EngineDirError:
        build_engine(BuildConfig(model=name, out=out))
    return out


def real_tokens(tokenizer, rows: int, length: int) -> np.ndarray:
    from trtserve.data.corpus import wiki_text

    out = [tokenizer(wiki_text(2 * length, 10 * i), add_special_tokens=False)["input_ids"][:length]
           for i in range(rows)]
    return np.array(out, dtype=np.int64)


def bench_minilm(engine_dir: Path, seconds: float) -> list[tuple]:
    import torch

    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve
    from trtserve.runtime import load_backend

    model = load_torch_model(resolve("all-MiniLM-L6-v2"), attention="eager")
    ours = load_backend(engine_dir)
    tokenizer = load_hf_tokenizer(engine_dir)
    rows = []
    for batch in (1, 32):
        ids = real_tokens(tokenizer, batch, 128)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}

        def baseline(tensors=tensors):
            with torch.inference_mode():
                hidden = model(**tensors).last_hidden_state
                return hidden.mean(1)

        rows.append((f"MiniLM embed batch {batch}, seq 128", timed(baseline, seconds),
                     timed(lambda feeds=feeds: ours.infer(feeds), seconds)))
    return rows


def bench_smollm2(engine_dir: Path, seconds: float) -> list[tuple]:
    import torch
    from transformers import DynamicCache

    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve
    from trtserve.runtime import generate, load_backend

    model = load_torch_model(resolve("SmolLM2-135M-Instruct"), attention="eager")
    ours = load_backend(engine_dir)
    ids = real_tokens(load_hf_tokenizer(engine_dir), 1, 129)
    prompt, next_id = ids[:, :128], ids[:, 128:]
    mask = np.ones_like(prompt)
    t_prompt, t_mask = torch.from_numpy(prompt), torch.from_numpy(mask)

    def hf_prefill():
        with torch.inference_mode():
            return model(input_ids=t_prompt, attention_mask=t_mask).logits

    def ours_prefill():
        return generate.step(ours, generate.start(ours, 1), prompt, mask)

    rows = [("SmolLM2 prefill 128 tokens", timed(hf_prefill, seconds), timed(ours_prefill, seconds))]

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=t_prompt, attention_mask=t_mask, cache=cache, use_cache=True)
    t_next, t_mask_next = torch.from_numpy(next_id), torch.ones(1, 129, dtype=torch.int64)

    def hf_decode():
        with torch.inference_mode():
            model(input_ids=t_next, attention_mask=t_mask_next, cache=cache, use_cache=True)
        cache.crop(-1)  # drop the new token: every timed step sees past length 128

    state = generate.start(ours, 1)
    generate.step(ours, state, prompt, mask)
    feeds = {"input_ids": next_id, "attention_mask": np.ones((1, 129), np.int64),
             "position_ids": np.array([[128]], np.int64), **generate.logit_feed(ours, 1, True), **state.past}
    rows.append(("SmolLM2 decode 1 token at past 128", timed(hf_decode, seconds),
                 timed(lambda: ours.infer(feeds), seconds)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, default=Path("engines"), help="engine dirs (built if missing)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per figure")
    args = parser.parse_args()
    from trtserve.runtime.base import available_cores

    minilm = ensure_engine("all-MiniLM-L6-v2", args.engines / "minilm")
    smollm2 = ensure_engine("SmolLM2-135M-Instruct", args.engines / "smollm2")
    rows = bench_minilm(minilm, args.seconds) + bench_smollm2(smollm2, args.seconds)
    print(f"CPU, {available_cores()} threads, fp32, median latency after warm-up")
    print(f"{'case':<38} {'torch eager':>12} {'trtserve ORT':>13} {'speedup':>8}")
    for label, base, ours in rows:
        print(f"{label:<38} {base:>9.2f} ms {ours:>10.2f} ms {base / ours:>7.2f}x")


if __name__ == "__main__":
    main()

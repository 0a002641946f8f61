"""One short GPU check (under 5 minutes on one GPU): what TensorRT exists, then the torch CUDA
reference of both bundled models under fp32, autocast fp16 (torch's mixed list: matmuls fp16,
softmax/norms/reductions fp32, the closest torch analogue of the hybrid policy) and pure fp16:
latency, speedup over fp32, fidelity against fp32 on real Wikipedia text. One table.

    python -m benchmarks.probes.gpu_check [--device cuda|cpu] [--lengths 128 512] [--batch 8] [--seconds 2]

On a machine without a GPU, `--device cpu --lengths 32 --batch 2 --seconds 0.2` runs the same code
path as a smoke check (autocast then uses bfloat16, and the figures say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def timed(fn, sync, seconds: float, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples, start = [], time.perf_counter()
    while len(samples) < 5 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def batch(tokenizer, rows: int, length: int, device):
    import torch

    from trtserve.data.corpus import wiki_text

    ids = [tokenizer(wiki_text(2 * length, 10 * i), add_special_tokens=False)["input_ids"][:length]
           for i in range(rows)]
    ids = torch.tensor(ids, device=device)
    return ids, torch.ones_like(ids)


def fidelity(ref, out) -> dict:
    import numpy as np

    from trtserve.precision.fidelity import (
        cosine,
        nonfinite_count,
        top1_agreement,
        worst_row_cosine,
    )

    r, o = ref.float().cpu().numpy(), out.float().cpu().numpy()
    row = {"cosine": cosine(r, o), "worst_token_cosine": worst_row_cosine(r.reshape(-1, r.shape[-1]),
                                                                          o.reshape(-1, o.shape[-1])),
           "nonfinite": nonfinite_count(o)}
    if r.shape[-1] > 10000:  # logits
        row["top1"] = top1_agreement(r, o)
    return {k: float(v) if isinstance(v, (float, np.floating)) else v for k, v in row.items()}


def run_model(name: str, args, device) -> list[dict]:
    import torch

    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve

    source = resolve(name)
    tokenizer = load_hf_tokenizer(source.path)
    fp32 = load_torch_model(source, attention="eager").to(device)
    half = load_torch_model(source, attention="eager").to(device).half() if device.type == "cuda" else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    low = torch.float16 if device.type == "cuda" else torch.bfloat16
    rows = []
    for length in args.lengths:
        ids, mask = batch(tokenizer, args.batch, length, device)

        def output(model, autocast=False, ids=ids, mask=mask):
            with torch.inference_mode(), torch.autocast(device.type, dtype=low, enabled=autocast):
                result = model(input_ids=ids, attention_mask=mask)
            return result.logits if hasattr(result, "logits") else result.last_hidden_state

        ref = output(fp32)
        base = timed(lambda: output(fp32), sync, args.seconds)
        variants = [("autocast " + str(low).split(".")[-1], lambda: output(fp32, autocast=True))]
        if half is not None:
            variants.append(("fp16 (model.half())", lambda: output(half)))
        rows.append({"model": name, "length": length, "batch": args.batch, "run": "fp32", "ms": base, "speedup": 1.0})
        for label, fn in variants:
            ms = timed(fn, sync, args.seconds)
            rows.append({"model": name, "length": length, "batch": args.batch, "run": label, "ms": ms,
                         "speedup": base / ms, **fidelity(ref, fn())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    import torch

    from trtserve.doctor import render, report

    print(render(report()))
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    rows = [r for name in ("all-MiniLM-L6-v2", "SmolLM2-135M-Instruct") for r in run_model(name, args, device)]
    print(f"{'model':<24} {'len':>4} {'run':<22} {'ms':>8} {'speedup':>8} {'cosine':>9} {'worst tok':>9} "
          f"{'NaN/Inf':>8} {'top-1':>6}")
    for r in rows:
        print(f"{r['model']:<24} {r['length']:>4} {r['run']:<22} {r['ms']:>8.2f} {r['speedup']:>7.2f}x "
              f"{r.get('cosine', 1.0):>9.6f} {r.get('worst_token_cosine', 1.0):>9.6f} {r.get('nonfinite', 0):>8} "
              f"{r.get('top1', float('nan')):>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

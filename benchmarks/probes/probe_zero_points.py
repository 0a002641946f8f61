"""Can SmolLM2's Q4_1 weights take ONNX Runtime's fast 4-bit form? `MatMulNBits` runs fastest with integer zero
points (w = s·(q − z), z an integer 0..15), while a Q4_1 block is w = d·q + m with a float minimum m, which the
builder keeps exact through a small extra GEMM (`probe_block_minimum.py`). This probe re-rounds every linear
layer's blocks of 32 to integer zero points in the torch reference and measures what that costs against the
same model untouched, on the gate's cases (`probe_activation_forms.py`: Wikipedia and random ids at each length,
padded and unpadded):

- "round": the block's own scale d, z = round(−m/d): every weight of the block moves by the same d·(z + m/d);
- "search": per block, the scale (d × 1 ± k/64, k ≤ 8) and z (floor, ceil, round of −min/s) with the least
  squared error.

    .venv/bin/python -m benchmarks.probes.probe_zero_points [--lengths 32,128,512,2048]
"""

from __future__ import annotations

import argparse

BLOCK = 32


def integer_zero_points(weight, search: bool):
    """`weight` (out, in) re-rounded in blocks of BLOCK along `in` to s·(q − z), q and z integers in 0..15."""
    import torch

    rows, cols = weight.shape
    blocks = weight.reshape(rows, cols // BLOCK, BLOCK)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    step = ((high - low) / 15).clamp_min(1e-12)  # a Q4_1 block's d: its codes span 0..15
    best = error = None
    for factor in ([1 + k / 64 for k in range(-8, 9)] if search else [1.0]):
        scale = step * factor
        start = -low / scale
        for zero in ([start.floor(), start.ceil(), start.round()] if search else [start.round()]):
            zero = zero.clamp(0, 15)
            rounded = scale * ((blocks / scale).round().add(zero).clamp(0, 15) - zero)
            err = ((rounded - blocks) ** 2).sum(-1, keepdim=True)
            if best is None:
                best, error = rounded, err
            else:
                better = err < error
                best, error = torch.where(better, rounded, best), torch.where(better, err, error)
    return best.reshape(rows, cols)


def main() -> None:
    import torch

    from benchmarks.common.fidelity import (
        decoder_cases,
        decoder_logits,
        meets_target,
        worst_over,
    )
    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve
    from trtserve.precision.measure import Corpus, Target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--lengths", default="32,128,512,2048")
    args = parser.parse_args()
    source = resolve(args.model)
    model = load_torch_model(source, attention="eager")
    tokenizer = load_hf_tokenizer(source.path)
    cases = decoder_cases(tokenizer, Corpus.wikipedia(), [int(n) for n in args.lengths.split(",")])
    reference = {label: decoder_logits(model, ids, mask) for label, ids, mask, _ in cases}
    layers = {name: p for name, p in model.named_parameters() if name.endswith("proj.weight")}
    exact = {name: p.detach().clone() for name, p in layers.items()}
    target = Target.for_weights("int4", "decoder")
    print(f"{args.model}: {len(layers)} linear layers re-rounded (the LM head untouched); reference: the same model "
          f"as loaded. int4 target: top-1 >= {target.min_top1:.0%}, perplexity change <= {target.max_ppl_delta:.0%}.")
    print("| form | largest weight change / largest weight | top-1 (worst case) | perplexity change (worst) | "
          "worst-token cosine, real | worst-token cosine, random ids | meets int4 target |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for form in ("round", "search"):
        with torch.no_grad():
            for name, p in layers.items():
                p.copy_(integer_zero_points(exact[name], form == "search"))
            moved = max(float((p - exact[n]).abs().max() / exact[n].abs().max()) for n, p in layers.items())
        top1, ppl, real_cos, random_cos, overall = worst_over(model, cases, reference)
        meets = meets_target(target, top1, ppl, real_cos, random_cos, overall)
        print(f"| {form} | {moved:.3f} | {top1:.2%} | {ppl:.2%} | {real_cos:.6f} | {random_cos:.6f} | "
              f"{'yes' if meets else 'no'} |", flush=True)


if __name__ == "__main__":
    main()

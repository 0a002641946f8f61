"""What each form of cheaper GEMM activations costs in fidelity, on the exact weights, before any kernel is
built: the torch reference model with every linear layer's input (the LM head's too) passed through one form,
against the same model untouched, on the shapes the build's gate measures.

Forms (blocks run along each GEMM's input dimension, as ONNX Runtime's MatMulNBits blocks its weights):
- `int8/32`: each block of 32 activations rounded to int8 by its largest magnitude (MatMulNBits accuracy level 4,
  llama.cpp's Q8 activations for Q4_1): the form the build's int8-activation plans use today.
- `int8/16`: the same in blocks of 16.
- `int8+residual`: int8/32, and the rounding residual rounded the same way and added back (two int8 rows per
  activation row through the same weights: about 16 bits).
- `int8, N outliers fp32`: the N input channels with the largest magnitudes on calibration text (other text than
  the measured one) stay fp32 (a small fp32 GEMM), the rest int8/32 (LLM.int8(), arXiv 2208.07339, with the
  channels chosen once).
- `bf16`: activations and weights rounded to bfloat16 (what a CPU with avx512_bf16 computes when told to).

Decoders (SmolLM2: its weights are the Q4_1 file's, so int4 and gguf engines hold exactly these): top-1 agreement,
perplexity change and worst-token logit cosine on Wikipedia text, lengths 32, 128, 512 (2 rows, one left-padded by
a quarter) and 2,048 (1 row), real text at batch 8 x 128 with half the rows padded; worst-token cosine on random
ids at batch 1 on every length. Encoders (MiniLM, with every GEMM's weights in the int8 policy's blocks of 32):
mean and worst sentence cosine and top-10 neighbours on the 200 Pang & Lee sentences, worst-token cosine on
Wikipedia at 128 and 512 tokens. Each form is checked against the default target of its policy.

    .venv/bin/python -m benchmarks.probes.probe_activation_forms [--model SmolLM2-135M-Instruct|all-MiniLM-L6-v2]
        [--forms int8/32,int8/16,int8+residual,outliers:8,outliers:32,bf16] [--lengths 32,128,512,2048]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common.fidelity import (
    decoder_cases,
    decoder_logits,
    meets_target,
    worst_over,
)

DEFAULT_FORMS = "none,int8/32,int8/16,int8+residual,outliers:8,outliers:32,bf16"


def blocked_int8(x, block: int):
    """x with each block of `block` values along the last axis rounded to int8 by its absolute maximum."""
    import torch

    shape = x.shape
    blocks = x.reshape(*shape[:-1], shape[-1] // block, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / scale) * scale).reshape(shape)


def activation_form(form: str, outliers: dict, name: str):
    """The function a linear layer's input goes through under `form`."""
    import torch

    if form == "none":
        return lambda x: x
    if form.startswith("int8/"):
        block = int(form.split("/")[1])
        return lambda x: blocked_int8(x, block)
    if form == "int8+residual":
        def residual(x):
            first = blocked_int8(x, 32)
            return first + blocked_int8(x - first, 32)
        return residual
    if form.startswith("outliers:"):
        keep = outliers[name]  # bool [K]: the channels that stay fp32
        return lambda x: blocked_int8(torch.where(keep, 0.0, x), 32) + torch.where(keep, x, 0.0)
    if form == "bf16":
        return lambda x: x.bfloat16().float()
    raise ValueError(f"unknown form {form!r}")


class Forms:
    """Every nn.Linear of a model computing with its weights `weight_of(name, W)` and its input through a form."""

    def __init__(self, model, weight_of=lambda name, w: w):
        import torch

        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.weights = {name: weight_of(name, m.weight.detach()) for name, m in self.layers.items()}
        self.form, self.outliers = "none", {}
        for name, layer in self.layers.items():
            layer.forward = self._forward(name, layer)

    def _forward(self, name, layer):
        import torch.nn.functional as F

        def forward(x):
            weight = self.weights[name]
            if self.form == "bf16":
                weight = weight.bfloat16().float()
            return F.linear(self.act[name](x), weight, layer.bias)
        return forward

    def use(self, form: str) -> None:
        self.form = form
        chosen = self.outliers.get(int(form.split(":")[1]), {}) if form.startswith("outliers:") else {}
        self.act = {name: activation_form(form, chosen, name) for name in self.layers}

    def calibrate(self, model, batches: list, counts: list[int]) -> None:
        """The `count` largest-magnitude input channels of each layer on `batches` (other text than measured)."""
        import torch

        peaks = {}
        hooks = [layer.register_forward_pre_hook(
            lambda m, args, n=name: peaks.__setitem__(n, torch.maximum(
                peaks.get(n, torch.zeros(args[0].shape[-1])), args[0].abs().reshape(-1, args[0].shape[-1]).amax(0))))
            for name, layer in self.layers.items()]
        self.use("none")
        with torch.inference_mode():
            for kwargs in batches:
                model(**kwargs)
        for hook in hooks:
            hook.remove()
        for count in counts:
            for name, peak in peaks.items():
                keep = torch.zeros_like(peak, dtype=torch.bool)
                keep[torch.topk(peak, count).indices] = True
                self.outliers.setdefault(count, {})[name] = keep


def probe_decoder(args, source) -> None:
    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.precision.measure import Corpus, Target

    model = load_torch_model(source, attention="eager")
    tokenizer = load_hf_tokenizer(source.path)
    corpus = Corpus.wikipedia()
    cases = decoder_cases(tokenizer, corpus, args.lengths)
    forms = Forms(model)
    calibration = Corpus(corpus.paragraphs[len(corpus.paragraphs) // 2 + 7:], "calibration")
    cal_ids = np.array(calibration.rows(tokenizer, 4, 128, special=False), np.int64)
    import torch

    forms.calibrate(model, [{"input_ids": torch.from_numpy(cal_ids)}], args.outlier_counts)
    forms.use("none")
    reference = {label: decoder_logits(model, ids, mask) for label, ids, mask, _ in cases}
    targets = {"int4": Target.for_weights("int4", "decoder"), "gguf default": Target()}
    print(f"{args.model}: every linear layer's input (211 GEMMs and the LM head) through the form; reference: the "
          f"same weights on fp32 activations. Real text: {corpus.name}.")
    print("| form | top-1 (worst case) | perplexity change (worst) | worst-token cosine, real | worst-token cosine, "
          "random ids | meets int4 target | meets gguf default | seconds |")
    print("|---|---:|---:|---:|---:|---|---|---:|")
    for form in args.forms:
        started = time.perf_counter()
        forms.use(form)
        top1, ppl, real_cos, random_cos, overall = worst_over(model, cases, reference)
        meets = {key: meets_target(t, top1, ppl, real_cos, random_cos, overall) for key, t in targets.items()}
        print(f"| {form} | {top1:.2%} | {ppl:.2%} | {real_cos:.6f} | {random_cos:.6f} | "
              f"{'yes' if meets['int4'] else 'no'} | {'yes' if meets['gguf default'] else 'no'} | "
              f"{time.perf_counter() - started:.0f} |", flush=True)


def probe_encoder(args, source) -> None:
    import torch

    from trtserve.data.sentiment import polarity
    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.precision.fidelity import compare
    from trtserve.precision.measure import Corpus, Target, neighbour_agreement
    from trtserve.precision.weight_quant import quantize_rows

    model = load_torch_model(source)
    tokenizer = load_hf_tokenizer(source.path)
    corpus = Corpus.wikipedia()
    int8 = lambda name, w: torch.from_numpy(quantize_rows(w.numpy(), "int8").dequantized())  # noqa: E731
    forms = Forms(model, int8)
    texts, _ = polarity()
    sentences = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    wiki = [np.array(corpus.rows(tokenizer, 8, length), np.int64) for length in (128, 512)]
    cal = np.array(Corpus(corpus.paragraphs[len(corpus.paragraphs) // 2 + 7:], "cal").rows(tokenizer, 4, 128))
    forms.calibrate(model, [{"input_ids": torch.from_numpy(cal)}], args.outlier_counts)

    def run(weights_exact: bool):
        saved = forms.weights
        if weights_exact:
            forms.weights = {name: layer.weight.detach() for name, layer in forms.layers.items()}
        with torch.inference_mode():
            hidden = model(**sentences).last_hidden_state
            m = sentences["attention_mask"].unsqueeze(-1).float()
            pooled = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1).numpy()
            tokens = [model(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy() for ids in wiki]
        forms.weights = saved
        return pooled, tokens

    forms.use("none")
    ref_pooled, ref_tokens = run(weights_exact=True)
    target = Target.for_weights("int8", "encoder")
    print(f"{args.model}: every GEMM's weights int8 in blocks of 32 (the int8 policy's format; the shipped engine "
          "keeps some fp32), inputs through the form; reference: the fp32 checkpoint. Sentences: 200 Pang & Lee; "
          f"tokens: {corpus.name} at 8 x 128 and 8 x 512.")
    print("| form | mean sentence cosine | worst sentence | top-10 neighbours | worst-token cosine | meets int8 "
          "encoder target (flips not measured) |")
    print("|---|---:|---:|---:|---:|---|")
    for form in args.forms:
        forms.use(form)
        pooled, tokens = run(weights_exact=False)
        cos = (pooled * ref_pooled).sum(-1)
        token_cos = min(compare(r, t)["worst_row_cosine"] for r, t in zip(ref_tokens, tokens))
        overall = min(compare(r, t)["cosine"] for r, t in zip(ref_tokens, tokens))
        neighbours = neighbour_agreement(ref_pooled, pooled)
        meets = (cos.mean() >= target.min_mean_cosine and token_cos >= target.min_token_cosine
                 and overall >= target.min_cosine and neighbours >= target.min_neighbours)
        print(f"| {form} | {cos.mean():.6f} | {cos.min():.6f} | {neighbours:.1%} | {token_cos:.6f} | "
              f"{'yes' if meets else 'no'} |", flush=True)


def main() -> None:
    from trtserve.models.sources import resolve

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--forms", default=DEFAULT_FORMS)
    parser.add_argument("--lengths", default="32,128,512,2048")
    args = parser.parse_args()
    args.forms = args.forms.split(",")
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.outlier_counts = sorted({int(f.split(":")[1]) for f in args.forms if f.startswith("outliers:")})
    source = resolve(args.model)
    (probe_decoder if source.info.kind == "decoder" else probe_encoder)(args, source)


if __name__ == "__main__":
    main()

"""Which weights (GEMMs, embedding tables) of a genuine-fp32 checkpoint get the cheap format: measured,
never named.

Each weight's sensitivity is the effect on the model's output of quantizing that GEMM alone, measured on
real calibration text with the torch fp32 reference (the same dequantized values the graph will hold;
the reference is already loaded by the build, and a forward pass is far cheaper than an ONNX Runtime
session per GEMM). Decoders: the mean KL divergence of the next-token distribution; encoders: the mean
1 - cosine of the sentence embeddings. Then the smallest set of the most sensitive weights kept in the
safer format (int4 -> int8 -> fp32) for which the whole model meets the target on that text is found by
bisection over the ranking. The build's fidelity gate (ONNX Runtime, every length) has the last word.

torch Linear weights are matched to graph weights by their bytes, as GGUF blocks are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from trtserve.precision.gguf_blocks import BLOCK
from trtserve.precision.weight_quant import quantize_rows
from trtserve.progress import say

CALIBRATION_ROWS, CALIBRATION_LENGTH = 4, 128  # the whole mix is checked on these
RANKING_ROWS, RANKING_LENGTH = 2, 64  # each weight alone on these: one forward per weight, so kept short
SAFER = {"int4": "int8", "int8": "fp32"}


def weight_key(kind: str, rows: np.ndarray) -> str:
    """`kind` ("gemms" or "embeddings", as blocked.weight_candidates says: a tied LM head and embedding hold
    the same bytes), then the rows' hash."""
    return f"{kind}:" + hashlib.sha256(np.ascontiguousarray(rows, dtype=np.float32).tobytes()).hexdigest()[:32]


@dataclass
class Choice:
    formats: dict  # graph weight key -> "int4" | "int8" | "fp32"
    sensitivity: dict  # key -> measured effect of that weight quantized alone
    modules: dict  # key -> torch module name (for the report)
    whole: dict  # metrics of the chosen mix on the calibration text
    kept: int  # how many of the most sensitive weights were kept in the safer format
    kept_by_calibration: int | None = None  # set when the gate widened the choice: the count `whole` was measured at


class _Reference:
    """The torch model with swappable weights, and its fp32 outputs on the calibration rows and on the
    shorter ranking rows."""

    def __init__(self, model, kind: str, rows: list[list[int]]):
        import torch

        self.model, self.kind = model, kind
        ids = torch.tensor(rows, dtype=torch.int64)
        self.ids = {False: ids, True: ids[:RANKING_ROWS, :RANKING_LENGTH]}  # by `short`
        self.originals = {}
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and weight is not None and weight.ndim == 2:
                kind_ = "gemms" if isinstance(module, torch.nn.Linear) else "embeddings"
                self.originals.setdefault(weight_key(kind_, weight.detach().numpy()), (name, module, weight))
        self.base = {short: self._outputs(ids) for short, ids in self.ids.items()}

    def _outputs(self, ids):
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
            if self.kind == "decoder":
                return torch.log_softmax(out.logits, -1)
            if self.kind == "scorer":  # a cross-encoder: the batch's scores as one vector (B rows -> 1 x B)
                return out.logits.double().T
            return out.last_hidden_state.double().mean(1)

    def metrics(self, formats: dict, short: bool = False) -> dict:
        """Swap in the quantized weights of `formats`, run (on the ranking rows if `short`), restore; the
        effect against fp32."""
        import torch

        ids, base = self.ids[short], self.base[short]
        swapped = []
        try:
            for key, fmt in formats.items():
                if fmt == "fp32" or key not in self.originals:
                    continue
                _, module, weight = self.originals[key]
                rows = weight.detach().numpy()
                # a fresh Parameter: a tied LM head and embedding are measured (and quantized) apart
                module.weight = torch.nn.Parameter(torch.from_numpy(_dequantized(rows, fmt, key)), requires_grad=False)
                swapped.append((module, weight))
            out = self._outputs(ids)
        finally:
            for module, weight in swapped:
                module.weight = weight
        if self.kind == "decoder":
            return decoder_effect(base, out, ids)
        cos = torch.nn.functional.cosine_similarity(base, out, dim=-1)
        return {"effect": float((1 - cos).mean()), "mean_cosine": float(cos.mean()), "worst_cosine": float(cos.min())}


def decoder_effect(base, out, ids) -> dict:
    """Next-token log-probabilities `out` against the fp32 `base` ([B, T, V] torch tensors) on `ids` [B, T]:
    mean KL divergence (the effect), top-1 agreement and the relative change of perplexity."""
    import torch

    kl = (base.exp() * (base - out)).sum(-1, dtype=torch.float64)
    top1 = (base.argmax(-1) == out.argmax(-1)).double().mean()
    nll = lambda lp: -lp[:, :-1].gather(-1, ids[:, 1:, None]).mean()  # noqa: E731
    ppl_delta = abs(float(torch.exp(nll(out).double() - nll(base).double())) - 1)
    return {"effect": float(kl.mean()), "top1": float(top1), "ppl_delta": ppl_delta}


_CACHE: dict = {}


def _dequantized(rows: np.ndarray, fmt: str, key: str) -> np.ndarray:
    if (key, fmt) not in _CACHE:
        _CACHE[(key, fmt)] = quantize_rows(rows, fmt).dequantized()
    return _CACHE[(key, fmt)]


def meets(metrics: dict, target) -> bool:
    if "top1" in metrics:
        return metrics["top1"] >= target.min_top1 and metrics["ppl_delta"] <= target.max_ppl_delta
    return metrics["worst_cosine"] >= target.min_token_cosine and metrics["mean_cosine"] >= target.min_cosine


CACHE_VERSION = 3  # bump when the measurement changes


def choose(reference_model, kind: str, weights: dict, eight_bit: set, fmt: str, target, rows: list[list[int]],
           cache_dir=None, reference=None) -> Choice:
    """choose_uncached(), kept on disk under `cache_dir` keyed by everything it depends on: the weights'
    bytes (their keys), the format, the target and the calibration rows."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    if cache_dir is None:
        return choose_uncached(reference_model, kind, weights, eight_bit, fmt, target, rows, reference)
    key = hashlib.sha256(json.dumps([CACHE_VERSION, sorted(weights), sorted(eight_bit), fmt, asdict(target), rows,
                                     kind]).encode()).hexdigest()[:24]
    path = Path(cache_dir) / f"{fmt}-{key}.json"
    if path.is_file():
        say(f"weights: reusing the measured {fmt} mix {path}")
        return Choice(**json.loads(path.read_text()))
    choice = choose_uncached(reference_model, kind, weights, eight_bit, fmt, target, rows, reference)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(choice)))
    tmp.replace(path)
    return choice


def mixed(low: dict, sensitivity: dict, kept: int) -> dict:
    """The formats `low` with the `kept` most sensitive weights one step safer (int4 -> int8 -> fp32)."""
    safer = set(sorted(sensitivity, key=sensitivity.get, reverse=True)[:kept])
    return {k: (SAFER[f] if k in safer and f != "fp32" else f) for k, f in low.items()}


def widened(choice: Choice, kept: int) -> Choice:
    """`choice` with its `kept` most sensitive weights one step safer (`kept` >= choice.kept): the weights
    ranked after the choice's own kept ones still hold their starting format, so each moves one step."""
    ranked = sorted(choice.sensitivity, key=choice.sensitivity.get, reverse=True)
    formats = dict(choice.formats)
    for key in ranked[choice.kept:kept]:
        if formats.get(key, "fp32") != "fp32":
            formats[key] = SAFER[formats[key]]
    first = choice.kept if choice.kept_by_calibration is None else choice.kept_by_calibration
    return Choice(formats, choice.sensitivity, choice.modules, choice.whole, max(kept, choice.kept), first)


def choose_uncached(reference_model, kind: str, weights: dict, eight_bit: set, fmt: str, target,
                    rows: list[list[int]], reference=None) -> Choice:
    """`weights`: graph weight key -> [N, K] rows, for the GEMMs and tables the policy may quantize;
    those in `eight_bit` (tables, the LM head) start in int8, the others in `fmt`. A weight whose input
    dimension is no multiple of the block, or that the reference does not hold, stays fp32. `reference`:
    a model-specific stand-in for _Reference (its `originals` and `metrics`), built on `rows` already."""
    _CACHE.clear()
    ref = reference or _Reference(reference_model, kind, rows)
    low = {key: ("fp32" if r.shape[1] % BLOCK or key not in ref.originals else "int8" if key in eight_bit else fmt)
           for key, r in weights.items()}
    sensitivity = {key: ref.metrics({key: f}, short=True)["effect"] for key, f in low.items() if f != "fp32"}

    def mix(kept: int) -> dict:
        return mixed(low, sensitivity, kept)

    kept, best = 0, ref.metrics(mix(0))
    if not meets(best, target):
        lo, hi = 0, len(sensitivity)
        best = ref.metrics(mix(hi))
        while lo + 1 < hi:  # invariant: mix(hi) meets the target (or hi is everything), mix(lo) does not
            mid = (lo + hi) // 2
            m = ref.metrics(mix(mid))
            if meets(m, target):
                hi, best = mid, m
            else:
                lo = mid
        kept = hi
    formats = mix(kept)
    counts = {f: sum(v == f for v in formats.values()) for f in dict.fromkeys([fmt, "int8", "fp32"])}
    say("weights: " + ", ".join(f"{n} {f}" for f, n in counts.items())
        + f" (the {kept} most sensitive kept safer) on calibration text: "
        + ", ".join(f"{k} {v:.4g}" for k, v in best.items() if k != "effect"))
    modules = {k: ref.originals[k][0] for k in weights if k in ref.originals}
    return Choice(formats, sensitivity, modules, best, kept)

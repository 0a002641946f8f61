"""Which weights (GEMMs, embedding tables) of a genuine-fp32 checkpoint get the cheap format: measured,
never named.

Each weight's sensitivity is measured where it acts, in one calibration pass over real text with the torch fp32
reference: every GEMM (and table) computes its output again from the same input with its weight quantized (the
dequantized values the graph will hold), and the relative squared error of that output is its sensitivity: the
local error GPTQ and AWQ calibrate on, at the cost of about two forward passes for the whole model, whatever its
number of GEMMs. Then the smallest set of the most sensitive weights kept in the safer format (int4 -> int8 ->
fp32) for which the whole model meets the target on that text is found by bisection over the ranking (decoders:
top-1 agreement and perplexity of the next-token distribution; encoders: sentence cosine), each try quantizing
the weights as the forward pass reaches them, so no second copy of the model is held. The build's fidelity gate
(ONNX Runtime, every length) has the last word.

torch Linear weights are matched to graph weights by their bytes, as GGUF blocks are.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np

from trtserve.engine_dir.kinds import ModelKind
from trtserve.precision.gguf_blocks import BLOCK
from trtserve.precision.weight_quant import quantize_rows
from trtserve.progress import say

CALIBRATION_ROWS, CALIBRATION_LENGTH = 4, 128  # the whole mix is checked on these
RANKING_ROWS, RANKING_LENGTH = 2, 64  # where a model is ranked one forward per weight: kept short
# Ranked one forward per weight (each weight's effect on the output) while weights x parameters stays under this,
# as cheap as a few forward passes of a 0.1B model; above it, by each module's local error in one pass
ONE_PASS_ABOVE = 1e10
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
    """The torch model with its weights quantized as the forward pass reaches them, and its fp32 outputs on the
    calibration rows."""

    def __init__(self, model, kind: ModelKind, rows: list[list[int]]):
        import torch

        self.model, self.kind = model, kind
        self.ids = torch.tensor(rows, dtype=torch.int64)
        self.originals: dict[str, tuple] = {}  # key -> (its module's name, the module, ...)
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and weight is not None and weight.ndim == 2:
                kind_ = "gemms" if isinstance(module, torch.nn.Linear) else "embeddings"
                self.originals.setdefault(weight_key(kind_, weight.detach().numpy()), (name, module, weight))
        self.base = self._outputs(self.ids)
        self.short_ids, self.short_base = self.ids[:RANKING_ROWS, :RANKING_LENGTH], None

    def _outputs(self, ids):
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
            if self.kind == ModelKind.DECODER:
                return torch.log_softmax(out.logits, -1)
            if self.kind == ModelKind.SCORER:  # a cross-encoder: the batch's scores as one vector (B rows -> 1 x B)
                return out.logits.double().T
            return out.last_hidden_state.double().mean(1)

    def ranking(self, low: dict) -> dict:
        """{key: relative squared error of the module's output with its weight quantized to low[key] alone}, every
        weight measured in one forward pass on the calibration rows (each module computing again from its own
        input: the effect of its quantization where it acts)."""
        import torch

        errors: dict[str, list[float]] = {}

        def measure(key: str, fmt: str):
            def hook(module, args, kwargs, out):
                weight = module.weight
                module.weight = torch.nn.Parameter(_dequantized_tensor(weight, fmt), requires_grad=False)
                try:
                    again = module.forward(*args, **kwargs)
                finally:
                    module.weight = weight
                total = errors.setdefault(key, [0.0, 0.0])
                # in place and summed in float64: one temporary the size of the output (an LM head's is logits
                # of every calibration position), not four in float64
                total[0] += float(again.sub_(out).square_().sum(dtype=torch.float64))
                total[1] += float(out.square().sum(dtype=torch.float64))
            return hook

        handles = [self.originals[key][1].register_forward_hook(measure(key, fmt), with_kwargs=True)
                   for key, fmt in low.items() if fmt != "fp32" and key in self.originals]
        try:
            self._outputs(self.ids)
        finally:
            for handle in handles:
                handle.remove()
        measured = {key: (num / den if den > 0 else float(num > 0)) for key, (num, den) in errors.items()}
        # a module the pass never called: its quantization changes nothing
        return {key: measured.get(key, 0.0) for key, fmt in low.items() if fmt != "fp32" and key in self.originals}

    def effects(self, low: dict) -> dict:
        """{key: the whole model's effect with the weight quantized to low[key] alone}, one forward per weight on
        the short ranking rows: for models small enough that this costs little (ONE_PASS_ABOVE)."""
        if self.short_base is None:
            self.short_base = self._outputs(self.short_ids)
        return {key: self.metrics({key: fmt}, short=True)["effect"] for key, fmt in low.items()
                if fmt != "fp32" and key in self.originals}

    def metrics(self, formats: dict, short: bool = False) -> dict:
        """The whole model's effect against fp32 with the weights of `formats` quantized (on the short ranking
        rows if `short`): each module's weight is swapped for its quantized values as its forward begins and
        restored as it ends."""
        import torch

        ids, base = (self.short_ids, self.short_base) if short else (self.ids, self.base)
        assert base is not None  # the short rows' outputs are computed before any short measurement (effects)
        held = {}  # id(module) -> its own weight while the quantized one is in place

        def swap(fmt: str):
            def before(module, args):
                held[id(module)] = module.weight
                module.weight = torch.nn.Parameter(_dequantized_tensor(module.weight, fmt), requires_grad=False)

            return before

        def restore(module, args, out):
            module.weight = held.pop(id(module))

        handles = []
        try:
            for key, fmt in formats.items():
                if fmt == "fp32" or key not in self.originals:
                    continue
                module = self.originals[key][1]
                handles += [module.register_forward_pre_hook(swap(fmt)), module.register_forward_hook(restore)]
            out = self._outputs(ids)
        finally:
            for handle in handles:
                handle.remove()
        if self.kind == ModelKind.DECODER:
            return decoder_effect(base, out, ids)
        cos = torch.nn.functional.cosine_similarity(base, out, dim=-1)
        return {"effect": float((1 - cos).mean()), "mean_cosine": float(cos.mean()), "worst_cosine": float(cos.min())}


def _dequantized_tensor(weight, fmt: str):
    """A torch weight's values after quantization to `fmt` (fp32, computed now, held by the caller only)."""
    import torch

    return torch.from_numpy(quantize_rows(weight.detach().numpy(), fmt).dequantized())


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


CACHE_VERSION = 6  # bump when the measurement changes


def choose(reference_model, kind: ModelKind, weights: dict, eight_bit: set, fmt: str, target, rows: list[list[int]],
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
    safer = set(sorted(sensitivity, key=sensitivity.__getitem__, reverse=True)[:kept])
    return {k: (SAFER[f] if k in safer and f != "fp32" else f) for k, f in low.items()}


def widened(choice: Choice, kept: int) -> Choice:
    """`choice` with its `kept` most sensitive weights one step safer (`kept` >= choice.kept): the weights
    ranked after the choice's own kept ones still hold their starting format, so each moves one step."""
    ranked = sorted(choice.sensitivity, key=choice.sensitivity.__getitem__, reverse=True)
    formats = dict(choice.formats)
    for key in ranked[choice.kept:kept]:
        if formats.get(key, "fp32") != "fp32":
            formats[key] = SAFER[formats[key]]
    first = choice.kept if choice.kept_by_calibration is None else choice.kept_by_calibration
    return Choice(formats, choice.sensitivity, choice.modules, choice.whole, max(kept, choice.kept), first)


def choose_uncached(reference_model, kind: ModelKind, weights: dict, eight_bit: set, fmt: str, target,
                    rows: list[list[int]], reference=None) -> Choice:
    """`weights`: graph weight key -> its shape as rows (N, K), for the GEMMs and tables the policy may quantize;
    those in `eight_bit` (tables, the LM head) start in int8, the others in `fmt`. A weight whose input
    dimension is no multiple of the block, or that the reference does not hold, stays fp32. `reference_model`:
    the torch model, or a call that loads it. `reference`: a model-specific stand-in for _Reference (its
    `originals`, `ranking` and `metrics`), built on `rows` already."""
    _CACHE.clear()
    if reference is None:
        import torch

        model = reference_model if isinstance(reference_model, torch.nn.Module) else reference_model()
        reference = _Reference(model, kind, rows)
    ref = reference
    low = {key: ("fp32" if shape[1] % BLOCK or key not in ref.originals else "int8" if key in eight_bit else fmt)
           for key, shape in weights.items()}
    started = time.perf_counter()
    ranked = [key for key, f in low.items() if f != "fp32"]
    one_pass = getattr(ref, "effects", None) is None or \
        sum(weights[key][0] * weights[key][1] for key in ranked) * len(ranked) > ONE_PASS_ABOVE
    sensitivity = ref.ranking(low) if one_pass else ref.effects(low)
    say(f"weights: {len(sensitivity)} ranked by " + ("their local error in one pass" if one_pass else
                                                   "their effect on the output, one forward each")
        + f" ({time.perf_counter() - started:.1f}s)")

    def mix(kept: int) -> dict:
        return mixed(low, sensitivity, kept)

    def measured(kept: int) -> dict:
        started = time.perf_counter()
        metrics = ref.metrics(mix(kept))
        say(f"weights: the {kept} most sensitive kept safer: "
            + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k != "effect")
            + f" ({'meets' if meets(metrics, target) else 'misses'} the target; {time.perf_counter() - started:.1f}s)")
        return metrics

    kept, best = 0, measured(0)
    if not meets(best, target):
        lo, hi = 0, len(sensitivity)
        best = measured(hi)
        while lo + 1 < hi:  # invariant: mix(hi) meets the target (or hi is everything), mix(lo) does not
            mid = (lo + hi) // 2
            m = measured(mid)
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

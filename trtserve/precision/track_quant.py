"""int8 and int4 for a parallel-track checkpoint's engines (engine_builder.sharding).

The same blocks, graph writer and choice as for other checkpoints (precision.weight_quant, .blocked,
.sensitivity): each track's projection in each layer is a weight of its own, measured alone on held-out
Wikipedia text with the torch reference (its stacked track weights swapped slice by slice); the embedding
table and the tied LM head start at 8 bits and are one weight. Then the engines, all tracks chained in one
process, are measured against the reference at every length up to the model's maximum (`fidelity`).
"""

from __future__ import annotations

import numpy as np

from trtserve.engine_dir.kinds import ModelKind
from trtserve.precision.sensitivity import (
    CALIBRATION_LENGTH,
    CALIBRATION_ROWS,
    RANKING_LENGTH,
    RANKING_ROWS,
    decoder_effect,
    weight_key,
)

KIND = ModelKind.PARALLEL_TRACK  # the choice's cache key: apart from other checkpoints' choices
LENGTHS = (32, 128, 512)  # and the model's maximum
ROWS = 4


class TrackReference:
    """sensitivity._Reference for the parallel-track model: `originals` maps each graph weight's key to
    (name, stacked tensor, track or None); `metrics` swaps the quantized values in place and restores them."""

    def __init__(self, model, rows: list[list[int]]):
        import torch

        self.model = model
        ids = torch.tensor(rows, dtype=torch.int64)
        self.ids = {False: ids, True: ids[:RANKING_ROWS, :RANKING_LENGTH]}
        self.originals: dict[str, tuple] = {}
        for index, layer in enumerate(model.layers):
            for name, stacked in layer.named_parameters():
                if stacked.ndim == 3:  # a projection per track [tracks, out, in]
                    for track in range(stacked.shape[0]):
                        key = weight_key("gemms", stacked[track].detach().numpy())
                        self.originals.setdefault(key, (f"layers.{index}.{name}[track {track}]", stacked, track))
        table = model.embed.weight
        self.originals[weight_key("embeddings", table.detach().numpy())] = ("embed (and the tied LM head)", table, None)
        self.base = {short: self._outputs(ids) for short, ids in self.ids.items()}

    def _outputs(self, ids):
        import torch

        with torch.inference_mode():
            return torch.log_softmax(self.model(ids)[0], -1)

    def ranking(self, low: dict) -> dict:
        """Each weight's effect on the model's output when quantized to low[key] alone (a forward per weight on
        the short rows: this model is small)."""
        return {key: self.metrics({key: fmt}, short=True)["effect"] for key, fmt in low.items() if fmt != "fp32"}

    def metrics(self, formats: dict, short: bool = False) -> dict:
        import torch

        from trtserve.precision.sensitivity import _dequantized

        ids, base = self.ids[short], self.base[short]
        saved = []
        try:
            with torch.no_grad():
                for key, fmt in formats.items():
                    if fmt == "fp32" or key not in self.originals:
                        continue
                    _, tensor, track = self.originals[key]
                    view = tensor.data if track is None else tensor.data[track]
                    saved.append((view, view.clone()))
                    view.copy_(torch.from_numpy(_dequantized(view.numpy(), fmt, key)))
            out = self._outputs(ids)
        finally:
            with torch.no_grad():
                for view, original in reversed(saved):
                    view.copy_(original)
        return decoder_effect(base, out, ids)


def held_out(model, length: int, rows: int, skip: int = 0) -> np.ndarray:
    """`rows` consecutive windows of `length` compact ids from the held-out 10% of the training text,
    after the first `skip` windows of that length."""
    from trtserve.models.parallel_track import corpus, to_compact

    stream = to_compact(corpus()[1], model.vocab).numpy()
    need = (skip + rows) * length
    if len(stream) < need:
        raise ValueError(f"the held-out text has {len(stream)} tokens, {need} are needed")
    return stream[skip * length:need].reshape(rows, length)


def choose_formats(model, fmt: str, target, cache_dir=None):
    """The sensitivity choice (sensitivity.Choice) for every projection of every track and the table, and
    the formats before any weight was kept safer (for sensitivity.mixed)."""
    from trtserve.precision.gguf_blocks import BLOCK
    from trtserve.precision.sensitivity import choose

    rows = held_out(model, CALIBRATION_LENGTH, CALIBRATION_ROWS).tolist()
    reference = TrackReference(model, rows)
    weights, eight_bit = {}, set()
    for key, (_, tensor, track) in reference.originals.items():
        weights[key] = tuple((tensor if track is None else tensor[track]).shape)
        if track is None:
            eight_bit.add(key)
    low = {key: "fp32" if shape[1] % BLOCK else "int8" if key in eight_bit else fmt
           for key, shape in weights.items()}
    return choose(model, KIND, weights, eight_bit, fmt, target, rows, cache_dir, reference), low


def escalation(kept: int, ranked: int) -> list[int]:
    """How many of the most sensitive weights to keep safer, in the order the gate tries them: the choice's
    own count, then 1/16, 1/8, 1/4, 1/2 and all of the ranked weights (the calibration text is shorter than
    the gate's shapes, so the choice can meet its target there and miss one of them)."""
    return sorted({kept} | {n for n in (ranked // 16, ranked // 8, ranked // 4, ranked // 2, ranked) if n > kept})


def graph_formats(formats: dict, model) -> dict:
    """`formats` keyed as the graphs' weights: the LM head (head.onnx's MatMul on the tied table) takes the
    table's format."""
    table = model.embed.weight.detach().numpy()
    formats = dict(formats)
    formats[weight_key("gemms", table)] = formats.get(weight_key("embeddings", table), "fp32")
    return formats


def fidelity(engines, model, target) -> dict:
    """The engines (all tracks, one process) against the torch reference on held-out text at LENGTHS and the
    model's maximum length (ROWS rows each), and on random ids; a report as the build gate writes it."""
    import torch

    from trtserve.precision.measure import failures, logits_case, target_json

    longest = model.cfg.max_positions
    lengths = sorted({n for n in LENGTHS if n < longest} | {longest})
    skip = CALIBRATION_ROWS * CALIBRATION_LENGTH  # windows after the calibration text
    cases = {}
    rng = np.random.default_rng(0)
    shapes = [("real", n) for n in lengths] + [("random", 128)]
    for kind, length in shapes:
        ids = (held_out(model, length, ROWS, skip=-(-skip // length)) if kind == "real"
               else rng.integers(1, model.cfg.vocab_size, (ROWS, length)))
        got = engines.forward(ids, reduce=lambda x: x, every_position=True)
        with torch.inference_mode():
            want = model(torch.from_numpy(ids))[0].numpy()
        cases[f"{kind} {ROWS}x{length}"] = {"input": kind,
                                            **logits_case(want, got, ids, np.ones_like(ids), kind == "real")}
    report = {"text": "Wikipedia, the training text's held-out 10%", "cases": cases}
    missed = failures(report, target)
    return {"onnxruntime": report, "passed": not missed, "failures": missed, "lengths": lengths,
            "text": report["text"], "target": target_json(target),
            "reference": "torch fp32, all tracks in one process"}


"""Run the fidelity measurement of an engine: as served (ONNX Runtime) and, for mixed policies,
under faithful fp16 emulation, both against HF's torch fp32 model on real text."""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict
from pathlib import Path

from trtserve.engine_dir.kinds import ModelKind
from trtserve.progress import say, step

LENGTHS = (32, 128, 512)
ORT_LABEL = "onnxruntime (CPU, as served: fp16 nodes computed in fp32)"
EMULATION_LABEL = "fp16 emulation (every fp16 node's inputs and outputs rounded to fp16, fp32 accumulation)"


def lengths_for(max_seq: int) -> list[int]:
    return sorted({n for n in LENGTHS if n <= max_seq} | {max_seq})


class Harness:
    """Reference model, tokenizer and text loaded once, for several fidelity runs of one engine."""

    def __init__(self, engine, source, target, calibration=None):
        from trtserve.models.loading import load_hf_tokenizer, load_torch_model
        from trtserve.precision.measure import Corpus
        from trtserve.precision.reference import Reference

        self.engine, self.target = engine, target
        self.corpus = Corpus.from_file(calibration) if calibration else Corpus.wikipedia()
        self.lengths = lengths_for(engine.manifest.shapes.sequence.max)
        self.kind = source.info.kind
        self.grid_shapes = []  # (name, input, batch, length, seed) from --confirm-grid, measured with `wide`
        # the torch fp32 model, loaded at its first use: the build's steps before the first measurement (ONNX
        # Runtime's optimization of a model as large) run without it in memory
        self.references = Reference(lambda: load_torch_model(source, attention="eager"))
        self.tokenizer = load_hf_tokenizer(source.path)

    @property
    def reference(self):
        """The torch fp32 model (what the sensitivity search runs, and encoders are measured against)."""
        return self.references.model

    def run(self, graph=None, decode: bool = True, lengths=None, wide: bool = True, backend=None) -> dict:
        """Measure the engine's own graph on ONNX Runtime, or `graph` (an emulation model) in its place, or the
        engine on `backend` (another backend of it, which the caller closes). `wide`: also the random-id and
        batch-8 shapes (`measure.wide_shapes`), not only the real-text cases. A decoder's reference runs first,
        and only its LM head stays in memory while the engine runs (precision.reference)."""
        from trtserve.precision.measure import decode_prompt, decoder_inputs, decoder_report, encoder_report, failures
        from trtserve.runtime.ort import OrtBackend

        lengths, grid = lengths or self.lengths, self.grid_shapes if wide else ()
        if self.kind == ModelKind.DECODER:
            inputs = decoder_inputs(self.engine, self.tokenizer, lengths, self.corpus, wide, grid)
            prompt = decode_prompt(self.engine, self.tokenizer, self.corpus) if decode else None
            self.references.prepare([(case.ids, case.mask) for case in inputs], prompt,
                                    self.tokenizer.pad_token_id or 0)
        with tempfile.TemporaryDirectory(prefix="trtserve-emulation-") as scratch:
            path = None
            if graph is not None:
                from trtserve.graph_files import save_graph

                path = Path(scratch) / "emulation.onnx"
                save_graph(graph, path)
            measured = backend or OrtBackend(self.engine, graph=path, arena=False)
            if self.kind == ModelKind.DECODER:
                report = decoder_report(measured, self.references, inputs, prompt, self.corpus.name)
            else:  # encoders and scorers
                report = encoder_report(measured, self.reference, self.tokenizer, lengths, self.corpus, wide=wide,
                                        grid=grid)
            if backend is None:
                measured.close()
        report["failures"] = failures(report, self.target)
        report["passed"] = not report["failures"]
        return report

    def emulated(self, fp32_model, policy, decode: bool = True, lengths=None, wide: bool = True) -> dict:
        from trtserve.precision.passes import emulation_model

        return self.run(emulation_model(fp32_model, policy), decode=decode, lengths=lengths, wide=wide)


def emulation_of(engine):
    """The fp16 emulation graph (onnx ModelProto) of an engine: its fp32 export with every node its policy
    puts in fp16 rounding its inputs and outputs to fp16 (what an fp16 GPU computes)."""
    import onnx

    from trtserve.precision.passes import emulation_model
    from trtserve.precision.policy import policy_from_manifest

    return emulation_model(onnx.load(engine.manifest.onnx.fp32_export_cache),
                           policy_from_manifest(engine.manifest.precision))


def measure_engine(engine, source, fp32_graph: Path, target, calibration=None, harness=None) -> dict:
    import onnx

    from trtserve.precision.policy import policy_from_manifest

    policy = policy_from_manifest(engine.manifest.precision)
    harness = harness or Harness(engine, source, target, calibration)
    harness.engine = engine  # the complete engine (a search may have run on a partial manifest)
    openvino = _served_openvino(engine)
    runs = ["onnxruntime"] + (["fp16_emulation"] if policy.anchors else []) + (["openvino"] if openvino else [])
    result = {"reference": "torch fp32 (transformers, eager attention)", "text": harness.corpus.name,
              "lengths": harness.lengths, "target": asdict(target), "labels": {}}
    for name in runs:
        with step(f"fidelity on {harness.corpus.name}: {name}, lengths {harness.lengths}"):
            if name == "onnxruntime":
                result[name] = harness.run()
            elif name == "openvino":
                assert openvino is not None  # runs has "openvino" only then
                result[name] = openvino_run(engine, harness, openvino)
            else:
                result[name] = harness.emulated(onnx.load(str(fp32_graph)), policy)
        result["labels"][name] = {"onnxruntime": ORT_LABEL, "fp16_emulation": EMULATION_LABEL}.get(
            name, openvino_label(openvino))
    result["failures"] = [f"{name}: {f}" for name in runs for f in result[name]["failures"]]
    result["passed"] = not result["failures"]
    return result


def _served_openvino(engine) -> str | None:
    """The OpenVINO precision `auto` serves this engine in here, or None (none chosen, or it cannot run here:
    then only what serves it is measured, and the step says why)."""
    entry = engine.manifest.openvino
    if not entry or not entry.chosen:
        return None
    from trtserve.runtime.openvino import unservable

    reason = unservable(entry)
    if reason:
        say(f"fidelity: its OpenVINO part is not measured: {reason}")
        return None
    return entry.inference_precision


def openvino_label(precision: str | None) -> str:
    return f"openvino (CPU, the portable graph computed in {precision})"


def openvino_run(engine, harness: Harness, precision: str) -> dict:
    """The engine measured on OpenVINO in `precision`."""
    from trtserve.runtime.openvino import OpenVinoBackend

    backend = OpenVinoBackend(engine, precision=precision)
    try:
        return harness.run(backend=backend)
    finally:
        backend.close()


def _nan_min(values) -> float:
    """min() that returns NaN when any value is NaN (Python's min depends on the order)."""
    values = list(values)
    return float("nan") if any(math.isnan(v) for v in values) else min(values)


def worst(report: dict) -> dict:
    """The worst value of each metric over all real-text lengths (and decode steps); over the random-id
    shapes apart (`random_cosine`, `random_token_cosine`), where the report has them."""
    cases = list(report["cases"].values()) + ([report["decode"]] if "decode" in report else [])
    tensors = {kind: [v for case in cases if (case.get("input") == "random") == (kind == "random")
                      for v in case.values() if isinstance(v, dict) and "cosine" in v] for kind in ("real", "random")}
    every = tensors["real"] + tensors["random"]
    out = {
        "cosine": _nan_min(t["cosine"] for t in tensors["real"]),
        "token_cosine": _nan_min(t["worst_row_cosine"] for t in tensors["real"]),
        "max_abs_error": -_nan_min(-t["max_abs_error"] for t in every),
        "nonfinite": sum(t["nonfinite"] for t in every),
    }
    if tensors["random"]:
        out["random_cosine"] = _nan_min(t["cosine"] for t in tensors["random"])
        out["random_token_cosine"] = _nan_min(t["worst_row_cosine"] for t in tensors["random"])
    if any("top1_agreement" in case for case in cases):
        out["top1"] = _nan_min(case["top1_agreement"] for case in cases if "top1_agreement" in case)
        out["ppl_delta"] = -_nan_min(-case["perplexity_rel_delta"] for case in cases if "perplexity_rel_delta" in case)
    return out


def summary(fidelity) -> str:
    """One line of a fidelity record: a manifest's (engine_dir Fidelity) or a measurement's as measured."""
    from trtserve.engine_dir.manifest import Fidelity

    if not isinstance(fidelity, Fidelity):
        fidelity = Fidelity.model_validate(fidelity)
    parts = []
    for name, run in fidelity.runs().items():
        w = worst(run)
        text = (f"{name}: cos {w['cosine']:.6f}, worst-token cos {w['token_cosine']:.6f}, "
                f"max abs {w['max_abs_error']:.2e}, NaN/Inf {w['nonfinite']}")
        if "top1" in w:
            text += f", top-1 {w['top1']:.2%}, ppl delta {w['ppl_delta']:.2e}"
        if "random_cosine" in w:
            text += f"; random ids: cos {w['random_cosine']:.6f}, worst-token cos {w['random_token_cosine']:.6f}"
        ranking = run.get("ranking")
        if ranking:
            text += (f"; {ranking['data'].split(' (')[0]} as pairs: score error {ranking['max_score_error']:.2e}, "
                     f"top-10 agreement {ranking['top10_agreement']:.0%}")
        sentences = run.get("sentences")
        if sentences:
            text += (f"; {sentences['data'].split(' (')[0]}: mean cos {sentences['mean_cosine']:.6f}, worst "
                     f"{sentences['worst_cosine']:.6f}, top-10 neighbours {sentences['neighbours']:.1%}, sentiment "
                     f"flips {sentences['sentiment_flips']} of {sentences['sentiment_held_out']}")
        parts.append(text)
    verdict = "passed" if fidelity.passed else "FAILED"
    return f"{verdict} at lengths {fidelity.lengths} on {fidelity.text}: " + "; ".join(parts)


def screen_summary(report: dict, lengths: list[int], text: str) -> str:
    """summary() of one Harness.run report (a screen: no emulation, prefill only)."""
    from trtserve.engine_dir.manifest import Fidelity

    screen = Fidelity(onnxruntime=report, passed=report["passed"], failures=report["failures"], lengths=lengths,
                      text=text, target={})
    return summary(screen) + ", prefill only"

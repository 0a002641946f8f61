"""The OpenVINO part of an encoder's or cross-encoder's engine: the portable graph compiled by OpenVINO in each
inference precision this CPU computes natively, each measured at the gate like the ONNX Runtime graph and timed
against it on real text. `auto` serves OpenVINO where a precision met the target, was faster at the largest batch
timed and not slower at batch 1 beyond the timing's noise; --backend openvino serves it wherever one met the
target."""

from __future__ import annotations

import platform
import statistics
import time
from importlib import metadata

import numpy as np

from trtserve.errors import TrtServeError
from trtserve.progress import say, step

ROUNDS = 3  # interleaved rounds of the timing; medians
BATCH = 8  # the larger batch timed (or the engine's largest, if smaller): a full batch, kept short for the build
TOLERANCE = 0.95  # a shape other than the largest batch may run at this share of ONNX Runtime's speed (noise)
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_description() -> str:
    """The CPU's model name and the flags that decide which kernels run (Linux: /proc/cpuinfo)."""
    try:
        info = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    name = fields.get("model name", platform.machine())
    return f"{name} ({', '.join(f for f in FLAGS if f in flags) or 'none of ' + ', '.join(FLAGS)})"


def timing_feeds(engine, tokenizer, corpus) -> dict[str, dict[str, np.ndarray]]:
    """Real-text feeds at batch 1 and at BATCH (or the engine's largest batch), at the engine's usual length."""
    shapes = engine.manifest.shapes
    length = shapes.sequence.opt
    names = {spec.name for spec in engine.manifest.io.inputs}
    out = {}
    for batch in sorted({1, min(shapes.batch.max, BATCH)}):
        ids = np.array(corpus.rows(tokenizer, batch, length), dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        out[f"batch {batch} x {length}"] = {k: v for k, v in feeds.items() if k in names}
    return out


def time_against(backends: dict, feeds: dict, rounds: int = ROUNDS, calls: int = 2) -> dict:
    """{shape: {backend name: median ms}}: the backends take turns by round (order reversed every other round),
    each running `calls` calls per shape after one untimed call, so that neither is timed while the other's
    threads are still spinning down or its caches are cold."""
    times: dict[tuple, list[float]] = {(name, shape): [] for name in backends for shape in feeds}
    for r in range(rounds):
        for name in (list(backends) if r % 2 == 0 else list(backends)[::-1]):
            for shape, f in feeds.items():
                backends[name].infer(f)
                for _ in range(calls):
                    started = time.perf_counter()
                    backends[name].infer(f)
                    times[name, shape].append(time.perf_counter() - started)
    return {shape: {name: round(statistics.median(times[name, shape]) * 1e3, 3) for name in backends}
            for shape in feeds}


def measure_openvino(engine, harness, requested: bool, allow_low_fidelity: bool = False) -> tuple[dict, dict | None]:
    """(the manifest's `openvino` part, the fidelity report of the precision kept or None). Under auto, a
    precision OpenVINO cannot compile or run is recorded as missed, never a failed build."""
    from trtserve.precision.run import worst
    from trtserve.runtime.openvino import OpenVinoBackend, cpu_precisions, import_openvino
    from trtserve.runtime.ort import OrtBackend

    ov = import_openvino()
    native = cpu_precisions(ov.Core())
    skipped = {p: "not native on this CPU" for p in ("bf16", "f32") if p not in native}
    if "bf16" in native and harness.target.max_abs_error is not None:  # fp32's parity target
        skipped["bf16"] = f"not tried under a max abs error bound of {harness.target.max_abs_error:g} (fp32 parity)"
    precisions = [p for p in native if p not in skipped]
    ort_backend = OrtBackend(engine)
    feeds = timing_feeds(engine, harness.tokenizer, harness.corpus)
    reports: dict[str | None, dict]  # None: no precision kept
    tried, reports = [], {}
    try:
        for precision in precisions:
            with step(f"OpenVINO: the portable graph in {precision}, measured and timed"):
                backend = None
                try:
                    backend = OpenVinoBackend(engine, precision=precision)
                    report = harness.run(backend=backend)
                    record = {"precision": precision, "passed": report["passed"], "failures": report["failures"][:5],
                              "worst": worst(report)}
                    if report["passed"]:
                        reports[precision] = report
                        record["ms"] = time_against({"onnxruntime": ort_backend, "openvino": backend}, feeds)
                except Exception as exc:  # noqa: BLE001  (OpenVINO is optional under auto: its failure is a result)
                    if requested:
                        raise
                    record = {"precision": precision, "passed": False,
                              "failures": [f"OpenVINO could not run it: {type(exc).__name__}: {exc}"[:500]]}
                finally:
                    if backend is not None:
                        backend.close()
            tried.append(record)
            if "ms" in record and _faster(record["ms"]):
                break  # met the target and faster everywhere: a later (more exact, slower) precision is not needed
    finally:
        ort_backend.close()
    version = metadata.version("openvino")
    kept, chosen, why = _choose(tried, requested, skipped)
    say(f"openvino: {why}")
    part = {"version": version, "graph": engine.manifest.onnx.file, "inference_precision": kept,
            "chosen": chosen, "chosen_because": why, "threads": ort_backend.threads, "cpu": cpu_description(),
            "tried": tried}
    if requested and kept is None and not allow_low_fidelity:
        raise TrtServeError(f"--backend openvino: {why}; nothing was written (--allow-low-fidelity keeps the "
                            "engine, served by ONNX Runtime)")
    return part, reports.get(kept)


def _choose(tried: list[dict], requested: bool, skipped: dict[str, str]) -> tuple[str | None, bool, str]:
    """(precision kept, whether auto serves it, why): the fastest precision that met the target at the
    largest batch timed; served when requested, or when `_faster`."""
    passed = [t for t in tried if t["passed"]]
    note = f" ({'; '.join(f'{p}: {why}' for p, why in skipped.items())})" if skipped else ""
    if not passed:
        missed = "; ".join(f"{t['precision']}: {t['failures'][0]}" for t in tried)
        return None, False, f"no precision met the target{note}: {missed}"
    largest = lambda t: list(t["ms"])[-1]  # noqa: E731  (the shapes in order of batch)
    best = min([t for t in passed if _faster(t["ms"])] or passed, key=lambda t: t["ms"][largest(t)]["openvino"])
    speed = ", ".join(f"{shape} {ms['onnxruntime'] / ms['openvino']:.2f}x" for shape, ms in best["ms"].items())
    faster = _faster(best["ms"])
    said = f"{best['precision']} met the target{note}; speed against ONNX Runtime's graph: {speed}"
    if requested:
        return best["precision"], True, f"requested with --backend openvino; {said}"
    if faster:
        return best["precision"], True, f"auto: {said}"
    return best["precision"], False, f"auto: not served, not faster where the server batches, or under " \
        f"{TOLERANCE:.2f}x ONNX Runtime's speed on another shape: {said}"


def _faster(ms: dict) -> bool:
    """Faster than ONNX Runtime at the largest batch timed (where a busy server runs), and at least TOLERANCE
    of its speed (the timing's noise) on the other shapes."""
    *others, largest = ms.values()
    return largest["openvino"] < largest["onnxruntime"] and all(
        m["onnxruntime"] / m["openvino"] >= TOLERANCE for m in others)

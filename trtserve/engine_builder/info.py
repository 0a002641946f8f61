"""Human-readable form of a manifest for `trtserve info`."""

from __future__ import annotations

from trtserve.engine_dir import EngineDir
from trtserve.engine_dir.kinds import ModelKind


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _files(m) -> str:
    """The engine's size on disk, then each file's (weights as external data included)."""
    total = sum(entry.size for entry in m.files.values())
    return (f"files       {_mb(total)} on disk: "
            + ", ".join(f"{name} {_mb(entry.size)}" for name, entry in m.files.items()))


def describe_manifest(engine: EngineDir) -> str:
    from trtserve.precision.run import summary

    m = engine.manifest
    if m.parallel_tracks is not None:
        return _describe_tracks(engine)
    model, backend, arch = m.model, m.backend, m.model.architecture
    # what every engine the builder writes has
    assert backend is not None and m.precision is not None and m.onnx is not None and model.source_sha256 is not None
    assert m.shapes is not None and m.io is not None
    lines = [
        f"engine      {engine.path}",
        f"model       {model.id} ({model.family} {model.kind}, {arch.num_layers} layers, "
        f"hidden {arch.hidden_size}, {arch.num_heads} heads / {arch.num_kv_heads} KV heads)",
        *_structure(arch),
        *_pooling(m.pooling, model.kind, arch.num_labels),
        *_sampling(engine, model.kind),
        f"source      {model.source_path} (sha256 {model.source_sha256[:16]}...)",
        f"precision   {m.precision.policy}" + _graph(m.precision.graph or {}) + _search(m.precision.search),
        f"backend     {backend.name} {backend.onnxruntime_version} ({backend.chosen_because or ''})"
        + (f"; {backend.resident_mb} MB resident once loaded and run" if backend.resident_mb else ""),
        *([f"            int8 activations in {backend.int8_activations}"
           + "".join(f"; {t['plan']}" + (f" with {t['kept_safer']} weights kept safer" if "kept_safer" in t else "")
                     + " missed the target" for t in backend.int8_activations_missed or [])]
          if backend.int8_activations is not None else []),
        *_kv_graph(backend.kv_graph),
        *_tensorrt(m.tensorrt),
        *_openvino(m.openvino),
        f"onnx        {m.onnx.file} opset {m.onnx.opset} (sha256 {m.onnx.sha256[:16]}...)",
        "shapes      " + ", ".join(f"{axis} {r.min}..{r.max} (opt {r.opt})" for axis, r in m.shapes.axes().items()),
        "inputs      " + ", ".join(_io(spec) for spec in m.io.inputs[:4])
        + (f", ... ({len(m.io.inputs)} in all)" if len(m.io.inputs) > 4 else ""),
        "outputs     " + ", ".join(_io(spec) for spec in m.io.outputs[:3])
        + (f", ... ({len(m.io.outputs)} in all)" if len(m.io.outputs) > 3 else ""),
        f"fidelity    {summary(m.fidelity)}",
        _files(m),
        f"built       {m.created} in {m.build_seconds if m.build_seconds is not None else '?'}s with "
        + ", ".join(f"{k} {v}" for k, v in (m.versions or {}).items()),
        f"rebuild     {m.build_command}",
    ]
    return "\n".join(lines)


def _openvino(entry) -> list[str]:
    """The OpenVINO part: what auto serves, and each precision's timing against ONNX Runtime on its CPU."""
    if entry is None:
        return []
    served = "served by auto" if entry.chosen else "not served by auto"
    lines = [f"openvino    {entry.version}, {entry.inference_precision or 'no precision kept'}, {served}: "
             f"{entry.chosen_because}"]
    for t in entry.tried:
        timed = "; ".join(f"{shape} {ms['openvino']:.1f} ms vs {ms['onnxruntime']:.1f} ms"
                          for shape, ms in t.get("ms", {}).items())
        verdict = f"met the target; {timed}" if t["passed"] else f"missed the target: {t['failures'][0]}"
        lines.append(f"            {t['precision']}: {verdict}")
    lines.append(f"            timed on {entry.cpu}, {entry.threads} threads")
    return lines


def _sampling(engine: EngineDir, kind: ModelKind) -> list[str]:
    """A decoder's sampling defaults from its generation_config.json, which `serve` applies to what a request
    leaves out (--generation-config auto)."""
    from trtserve.errors import EngineDirError
    from trtserve.runtime.generation_defaults import generation_defaults

    if kind != ModelKind.DECODER:
        return []
    try:
        found = generation_defaults(engine.path)
    except EngineDirError as exc:
        return [f"sampling    {exc}"]
    if not found:
        return ["sampling    OpenAI's defaults (generation_config.json sets none of temperature, top_p, top_k, min_p, "
                "repetition_penalty)"]
    return ["sampling    " + ", ".join(f"{k}={v}" for k, v in found.items()) + " from generation_config.json, for "
            "what a request leaves out (serve --generation-config none: OpenAI's defaults)"]


def _describe_tracks(engine: EngineDir) -> str:
    from trtserve.precision.run import summary

    m, pt = engine.manifest, engine.manifest.parallel_tracks
    assert pt is not None and m.precision is not None and m.parity is not None  # every track engine's
    arch = m.model.architecture
    return "\n".join([
        f"engine      {engine.path}",
        f"model       {m.model.id} (parallel-track decoder, {arch.num_layers} layers, hidden "
        f"{arch.hidden_size}, {arch.num_heads} heads / {arch.num_kv_heads} KV heads)",
        f"tracks      {pt.tracks} tracks x {pt.segments} segments of {pt.block_depth} layers; "
        f"{pt.kv_heads_per_track} KV head(s) per track",
        f"sync        {pt.sync.op} of {pt.sync.of} after each segment: {pt.sync.per_forward} per forward",
        f"precision   {m.precision.policy}" + _track_formats(m.precision),
        *([f"fidelity    {summary(m.fidelity)}"] if m.fidelity is not None else []),
        f"parity      max abs error {m.parity.max_abs_error:.2e} ({m.parity.against})",
        _files(m),
        f"rebuild     {m.build_command}",
    ])


def _track_formats(precision) -> str:
    if precision.formats is None:
        return ""
    counts = ", ".join(f"{n} {fmt}" for fmt, n in precision.formats.items())
    missed = len(precision.int8_activations_missed or [])
    return (f": weights {counts} (the {precision.kept_safer} most sensitive kept safer); int8 activations in "
            f"{precision.int8_activations}"
            + (f" ({missed} earlier tr{'y' if missed == 1 else 'ies'} missed the target)" if missed else ""))


def _io(spec) -> str:
    return f"{spec.name} {spec.dtype}[{', '.join(map(str, spec.shape))}]"


def _widened(report: dict) -> str:
    first = report.get("kept_safer_by_calibration")
    if first is None:
        return "; on calibration text "
    return f", widened because the gate missed with the {first} chosen on calibration text, where that mix measured "


def _pooling(pooling, kind: ModelKind, labels: int | None = None) -> list[str]:
    """An encoder's vector: its pooling modes, Dense modules and Normalize, and where they were read."""
    if kind == ModelKind.SCORER:
        head = "one logit, scored as its sigmoid (raw_scores: the logit)" if labels == 1 else f"{labels} logits"
        return [f"scores      cross-encoder, {head}; pairs on /v1/rerank, /rerank and /v1/score"]
    if kind != ModelKind.ENCODER:
        return []
    if pooling is None:
        return ["pooling     mean, normalized after the graph (an engine built before pooling was in the graph)"]
    dense = "".join(f" -> dense {d.in_features}->{d.out_features} {d.activation}" for d in pooling.dense)
    prompts = f"; prompts {', '.join(sorted(pooling.prompts))}" if pooling.prompts else ""
    return [f"pooling     {' + '.join(pooling.modes)}{dense}"
            f"{', normalized' if pooling.normalize else ', not normalized'}"
            f" -> {pooling.dimensions} dims ({pooling.source}){prompts}"]


def _structure(arch) -> list[str]:
    """The family's windows and soft-caps, where it has them (models/families)."""
    parts = []
    if arch.sliding_windows:
        windowed = [i for i, w in enumerate(arch.sliding_windows) if w]
        parts.append(f"sliding window {max(w for w in arch.sliding_windows if w)} on {len(windowed)} of "
                     f"{arch.num_layers} layers")
    parts += [f"{what} soft-cap {cap:g}" for what, cap in (("attention", arch.attn_softcap),
                                                           ("final-logit", arch.final_softcap)) if cap]
    return [f"structure   {'; '.join(parts)}"] if parts else []


def _graph(report: dict) -> str:
    if not report:
        return ""
    if "gemms" in report:  # weights carried from a GGUF file
        from collections import Counter

        formats = Counter(v["format"] for v in [*report["gemms"].values(), *report["embeddings"].values()])
        if "source" not in report:  # quantized here, each weight's format chosen by measured sensitivity
            return (f" ({len(report['gemms'])} GEMMs and {len(report['embeddings'])} embeddings quantized, "
                    + ", ".join(f"{k} x{v}" for k, v in sorted(formats.items()))
                    + f"; {len(report['fp32'])} weights fp32; the {report['kept_safer']} most sensitive kept safer"
                    + _widened(report) + ", ".join(
                        f"{k} {v:.4g}" for k, v in report["calibration"].items() if k != "effect") + ")")
        return (f" (from {report['source']}: {len(report['gemms'])} GEMMs and {len(report['embeddings'])} embeddings "
                "read its blocks, " + ", ".join(f"{k} x{v}" for k, v in sorted(formats.items()))
                + f"; {len(report['fp32'])} weights fp32)")
    low, fp32 = sum(report["low_precision_nodes"].values()), sum(report["fp32_nodes"].values())
    patterns = ", ".join(f"{k} x{v['instances']}" for k, v in report["patterns_kept_fp32"].items() if v["instances"])
    return f" ({low} nodes fp16, {fp32} fp32, {report['casts_inserted']} casts; kept fp32: {patterns or 'none'})"


def _search(record: dict | None) -> str:
    """How auto chose its fp32 set."""
    if not record:
        return ""
    if record.get("hybrid_set"):
        return "; auto: hybrid's fp32 set (every candidate unit in fp32 missed a shape)"
    added = f", {record['gemm_units_added']} GEMMs among them" if record.get("gemm_units_added") else ""
    return f"; auto: {len(record['units_kept_fp32'])} of {record['candidate_units']} candidate units fp32{added}"


def _tensorrt(entry) -> list[str]:
    if entry is None:
        return []
    check = entry.layer_precision  # a record of engine_builder.tensorrt.check_precision
    by_type = check["float_outputs_by_layer_type"]
    kinds = ("MATRIX_MULTIPLY", "SOFTMAX", "NORMALIZATION", "REDUCE")
    types = ", ".join(f"{k.lower()} {'/'.join(f'{n} {t}' for t, n in by_type[k].items())}"
                      for k in kinds if k in by_type)
    kernels = entry.kernels or {"count": "?", "output_dtypes_by_kernel_type": {}}
    return [f"tensorrt    {entry.plan} ({entry.flavour} {entry.version}, {entry.compute_capability}, "
            f"profiles {', '.join(p.name for p in entry.profiles)})",
            f"            layer outputs: {types}; {len(check['violations'])} precision violations"
            + "".join(f"; {n} {t} weights" for t, n in check.get("quantized_weights", {}).items()),
            f"            kernels after fusion: {kernels['count']} ("
            + ", ".join(f"{k} {'/'.join(f'{n} {t}' for t, n in v.items())}"
                        for k, v in kernels["output_dtypes_by_kernel_type"].items()) + ")"]


def _kv_graph(entry) -> list[str]:
    if entry is None:
        return []
    if not entry.file:
        return [f"decode      no in-place KV graph: {entry.why_not}"]
    return [f"decode      {entry.file}: GroupQueryAttention over in-place KV buffers of {entry.capacity} tokens, "
            f"logits within {entry.check['max_relative_difference']:.1e} of the optimized graph"
            + (" (checked with fp32 activations in both: rounding moves 1e-8 kernel differences across its boundaries)"
               if entry.check.get("activations") else "")]

"""build-engine: a source resolved once, then the build's steps in order (export -> precision -> decode graph ->
TensorRT plan -> the fidelity gate), each adding its part of the manifest, sealed into the engine dir atomically."""

from __future__ import annotations

import gc
import hashlib
import json
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from trtserve import __version__, engine_dir
from trtserve.engine_builder.tensorrt import TrtOptions
from trtserve.engine_dir.kinds import ModelKind
from trtserve.engine_dir.manifest import KvGraph
from trtserve.errors import TrtServeError
from trtserve.fileio import atomic_dir, build_once, cache_root, check_writable_target
from trtserve.models.sources import WEIGHT_SUFFIXES, ModelSource, resolve
from trtserve.precision.measure import Target
from trtserve.precision.write import check_precision, target_for
from trtserve.progress import say, step

ONNX_FILE = "model.onnx"
EXPORT_FORMAT = 3  # bump when the exported graph contract changes: invalidates the ONNX cache
DEFAULT_MAX_SEQ = 2048
OPT_SEQ = 128


@dataclass(frozen=True)
class BuildConfig:
    model: str
    out: Path
    precision: str = "fp32"
    backend: str = "auto"
    max_batch: int = 32
    max_seq: int | None = None  # None: the model's position limit, capped at DEFAULT_MAX_SEQ
    calibration: Path | None = None  # text file for fidelity; None: the bundled Wikipedia sample
    fidelity_target: Target | None = None  # None: Target.parity() for fp32, Target() otherwise
    allow_low_fidelity: bool = False
    confirm_grid: str | None = None  # the name of an evaluation preset or grid file whose shapes the gate adds
    confirm_shapes: tuple = ()  # its (model, input, batch, length) shapes, and the seed of its random ids
    confirm_seed: int = 0
    trt: TrtOptions = field(default_factory=TrtOptions)  # used when the backend is tensorrt


def build_engine(cfg: BuildConfig) -> engine_dir.EngineDir:
    """Build the engine of `cfg.model` (any source: a bundled name, a checkpoint folder, a GGUF file, a
    parallel-track checkpoint, which becomes a track-sharded engine) into `cfg.out`."""
    from trtserve.models.parallel_track import is_parallel_track

    if is_parallel_track(Path(cfg.model)):
        return _build_tracks(cfg)
    check_precision(cfg.precision)
    if cfg.calibration is not None and not Path(cfg.calibration).is_file():
        raise TrtServeError(f"--calibration {cfg.calibration} is not a readable file: give a UTF-8 text file")
    if cfg.max_batch < 1:
        raise TrtServeError(f"--max-batch must be at least 1, got {cfg.max_batch}")
    check_writable_target(cfg.out)
    backend, why = backend_for(cfg.model, cfg.backend)
    if backend == "tensorrt":
        from trtserve.runtime.trt_lib import load_tensorrt

        trt, flavour = load_tensorrt()  # before the long export: a missing library is a quick, clear error
        if flavour == "tensorrt_rtx":
            from trtserve.engine_builder.tensorrt import rtx_targets

            rtx_targets(trt, cfg.trt.compute_capabilities)
        why += f"; {flavour} {trt.__version__}"
    say(f"backend: {backend} ({why})")
    source = resolve(cfg.model)
    check_precision(cfg.precision, source)
    if backend == "openvino":  # before the long export, as TensorRT's library above
        from trtserve.runtime.openvino import KINDS, import_openvino

        if source.info.kind not in KINDS:
            raise TrtServeError(f"--backend openvino builds encoders and cross-encoders; {source.model_id} is a "
                                f"{source.info.kind} (on decoders OpenVINO measured slower than ONNX Runtime)")
        import_openvino()
    max_seq = _max_seq(cfg, source)
    grid = None
    if cfg.confirm_grid:  # checked before the long export: a bad grid is a quick, clear error
        from trtserve.precision.measure import grid_shapes

        grid = grid_shapes(cfg.confirm_grid, cfg.confirm_shapes, cfg.confirm_seed, source.model_id, cfg.max_batch,
                           max_seq)
    started = time.time()
    with atomic_dir(cfg.out) as tmp:
        manifest = _build_into(tmp, cfg, source, max_seq, backend, why, grid)
        engine_dir.seal(tmp, dict(manifest, build_seconds=round(time.time() - started, 1)))
    return engine_dir.open_engine_dir(cfg.out, verify=False)


def _build_tracks(cfg: BuildConfig) -> engine_dir.EngineDir:
    """A parallel-track checkpoint: its tracks' engines (engine_builder/sharding.py), on ONNX Runtime."""
    from trtserve.engine_builder.sharding import build_track_engines

    if cfg.calibration:
        raise TrtServeError("--calibration is not taken for a parallel-track checkpoint: its engines are "
                            "measured on the held-out part of the text it was trained on")
    given = [flag for flag, value in (("--confirm-grid", cfg.confirm_grid), ("--max-seq", cfg.max_seq),
                                      ("--backend tensorrt", cfg.backend == "tensorrt"),
                                      ("--backend openvino", cfg.backend == "openvino")) if value]
    if given:
        raise TrtServeError(f"{', '.join(given)} is not taken for a parallel-track checkpoint: its engines run on "
                            "ONNX Runtime over the model's whole context, measured on its held-out text")
    return build_track_engines(Path(cfg.model), cfg.out, cfg.precision, cfg.fidelity_target, cfg.allow_low_fidelity)


def backend_for(model: str, requested: str) -> tuple[str, str]:
    """(backend, why) an engine of `model` is built for: a track-sharded engine runs on ONNX Runtime."""
    from trtserve.models.parallel_track import is_parallel_track
    from trtserve.runtime.devices import choose_backend

    if is_parallel_track(Path(model)):
        return "onnxruntime", "track-sharded engines run on ONNX Runtime"
    return choose_backend(requested)


def _max_seq(cfg: BuildConfig, source: ModelSource) -> int:
    limit = source.info.max_positions
    if cfg.max_seq is None:
        return min(limit, DEFAULT_MAX_SEQ)
    if cfg.max_seq < 2:
        raise TrtServeError(f"--max-seq must be at least 2, got {cfg.max_seq}")
    if cfg.max_seq > limit:
        raise TrtServeError(
            f"--max-seq {cfg.max_seq} is above {source.model_id}'s position limit "
            f"(max_position_embeddings={limit}): use --max-seq {limit} or less"
        )
    return cfg.max_seq


@dataclass
class _Draft:
    """What the build's steps share: the directory being written, the options, the resolved source, the
    files one step hands the next, and the manifest as it grows (each step adds its part)."""

    tmp: Path
    cfg: BuildConfig
    source: ModelSource
    max_seq: int
    backend: str
    why: str
    grid: list | None
    manifest: dict = field(default_factory=dict)
    fp32_graph: Path | None = None  # the export step's graph (in the export cache)
    backend_entry: dict = field(default_factory=dict)  # the precision step's backend section, the decode step adds to
    report: dict = field(default_factory=dict)  # the precision step's measurement, the gate judges
    harness: object = None  # the precision step's fidelity harness (reference model, text), later steps reuse

    def engine(self) -> engine_dir.EngineDir:
        return engine_dir.EngineDir(self.tmp, engine_dir.as_manifest(self.manifest))


def _build_into(tmp: Path, cfg: BuildConfig, source: ModelSource, max_seq: int, backend: str, why: str,
                grid=None) -> dict:
    """Run the build's steps in order into `tmp`; the manifest they composed."""
    draft = _Draft(tmp, cfg, source, max_seq, backend, why, grid)
    for run in (_export_step, _precision_step, _decode_graph_step, _tensorrt_step, _openvino_step, _gate_step):
        draft.manifest.update(run(draft))
    return draft.manifest


def _export_step(d: _Draft) -> dict:
    """The fp32 ONNX export (cached by the checkpoint's content), the tokenizer files, and what the engine is: the
    model, its inputs and outputs, the shapes it takes, its pooling."""
    source = d.source
    source_hash = source.source_hash()
    d.fp32_graph = _export_cached(source, source_hash)
    part = {
        "model": {
            "id": source.model_id,
            "source": source.ref,  # what `trtserve fidelity` resolves again: a bundled name, a hub id or a path
            "source_path": str(source.path),
            "source_sha256": source_hash,
            "family": source.info.family,
            "kind": source.info.kind,
            "architecture": vars(source.info),
        },
        "io": _io_from_graph(d.fp32_graph),  # the policy keeps graph inputs and outputs fp32
        "shapes": _shape_ranges(source, d.cfg.max_batch, d.max_seq),
        "versions": _versions(), "build_command": _rebuild_command(d.cfg),
    }
    if source.pooling is not None:
        part.update(pooling=source.pooling.to_json(source.info.hidden_size))
    if d.grid:  # the gate's cases from it are labelled "<label> <input> b<batch> seq<length>"
        part.update(confirm_grid={"grid": d.cfg.confirm_grid, "label": d.grid[0][0], "shapes": len(d.grid)})
    # before any measurement: --confirm-grid's real-text rows are tokenized from it
    _copy_tokenizer_files(source, d.tmp)
    return part


def _precision_step(d: _Draft) -> dict:
    """The precision policy written into the portable graph (precision/write.py) and lowered to ONNX Runtime's
    optimized graph, each try measured at the gate: the sections of the try it kept, and the measurement."""
    from trtserve.engine_builder.onnxruntime import OPTIMIZED, build_ort, map_weights, resident_mb
    from trtserve.precision.run import Harness
    from trtserve.precision.write import Gate, write_precision

    onnx_path = d.tmp / ONNX_FILE
    target = d.cfg.fidelity_target or target_for(d.cfg.precision, d.source.info.kind)
    harness = Harness(d.engine(), d.source, target, d.cfg.calibration)
    harness.grid_shapes = d.grid or []
    d.harness = harness

    def lower(graph: Path, int8_activations, residual=frozenset()) -> dict:  # portable -> ONNX Runtime's graph
        return dict(build_ort(graph, d.tmp, int8_activations, residual), chosen_because=d.why)

    def engine(precision: dict, backend_entry: dict, digest: str) -> engine_dir.EngineDir:
        d.manifest.update(onnx={"file": ONNX_FILE, "sha256": digest, "opset": _opset(onnx_path),
                                "exporter": "torch.onnx.export(dynamo=True)", "fp32_export_cache": str(d.fp32_graph)},
                          precision=precision, backend=backend_entry)
        return d.engine()

    assert d.fp32_graph is not None  # the export step's
    report = write_precision(d.cfg.precision, Gate(d.fp32_graph, onnx_path, d.source, harness, target, lower, engine))
    chosen = engine_dir.as_manifest(d.manifest)  # the sections of the try write_precision kept
    assert chosen.backend is not None
    d.backend_entry = dict(chosen.backend.model_dump(exclude_unset=True), weights=map_weights(d.tmp / OPTIMIZED),
                           resident_mb=resident_mb(d.tmp / OPTIMIZED))  # of the chosen graph only
    d.report = report
    return {"backend": d.backend_entry, "fidelity": report}


def _decode_graph_step(d: _Draft) -> dict:
    """A decoder's in-place decode graph (engine_builder/kv_graph.py), checked against the optimized graph."""
    from trtserve.engine_builder.onnxruntime import OPTIMIZED, map_weights, share_weights

    if d.source.info.kind != ModelKind.DECODER:
        return {}
    from trtserve.engine_builder.kv_graph import build_kv
    from trtserve.memory import return_freed_memory

    d.harness = None  # a decoder's torch reference (the fp32 model) is not needed past its gate: not held twice
    gc.collect()
    return_freed_memory()

    with step("writing the decode graph (attention over in-place KV buffers) and checking it"):
        kv = KvGraph.model_validate(build_kv(d.tmp, engine_dir.as_manifest(d.manifest)))
    if kv.file:
        map_weights(d.tmp / kv.file)
        kv = kv.model_copy(update={"weights": share_weights(d.tmp / OPTIMIZED, d.tmp / kv.file)})  # one copy of both
    else:
        say(f"no decode graph: {kv.why_not}; decoding copies the cache per step")
    return {"backend": dict(d.backend_entry, kv_graph=kv.model_dump(exclude_unset=True))}


def _tensorrt_step(d: _Draft) -> dict:
    """The TensorRT plan from the portable graph, where the build is for TensorRT; the ONNX Runtime graph stays
    beside it, the CPU fallback."""
    if d.backend != "tensorrt":
        return {}
    from trtserve.engine_builder.tensorrt import build_trt

    with step("building the TensorRT plan"):
        plan = build_trt(d.tmp / ONNX_FILE, d.tmp, engine_dir.as_manifest(d.manifest), d.cfg.trt)
    return {"tensorrt": dict(plan, chosen_because=d.why)}


def _openvino_step(d: _Draft) -> dict:
    """An encoder's or cross-encoder's OpenVINO part (engine_builder/openvino.py): with --backend openvino, or
    under auto where the openvino package is installed and no TensorRT plan is built."""
    from trtserve.runtime.openvino import KINDS, installed

    requested = d.backend == "openvino"
    if d.source.info.kind not in KINDS or not (requested or (d.cfg.backend == "auto" and d.backend == "onnxruntime")):
        return {}
    if not requested and not installed():
        say("openvino: not measured, the openvino package is not installed (pip install 'trtserve[openvino]')")
        return {}
    from trtserve.engine_builder.openvino import measure_openvino
    from trtserve.precision.run import openvino_label

    part, report = measure_openvino(d.engine(), d.harness, requested, d.cfg.allow_low_fidelity)
    if report is not None:
        d.report = dict(d.report, openvino=report,
                        labels=dict(d.report.get("labels") or {}, openvino=openvino_label(part["inference_precision"])))
    return {"openvino": part, "fidelity": d.report}


def _gate_step(d: _Draft) -> dict:
    """Nothing is written when the kept try misses the fidelity target, unless --allow-low-fidelity."""
    report = d.report
    if not report["passed"] and not d.cfg.allow_low_fidelity:
        first = "; ".join(report["failures"][:3])
        wider = " or ".join(p for p in ("hybrid", "fp32") if p != d.cfg.precision)
        raise TrtServeError(
            f"the {d.cfg.precision} engine misses the fidelity target ({len(report['failures'])} failures, e.g. "
            f"{first}); nothing was written. Use --precision {wider}, relax --fidelity-target, "
            "or pass --allow-low-fidelity to keep it anyway"
        )
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def remeasure(engine: engine_dir.EngineDir, calibration=None) -> dict:
    """`trtserve fidelity`: measure an existing engine again against its fp32 export, on any text."""
    from trtserve.precision.run import measure_engine

    source = resolve(engine.manifest.model.source)
    assert engine.manifest.fidelity is not None  # every checkpoint engine's
    target = Target(**engine.manifest.fidelity.target)
    return measure_engine(engine, source, fp32_export(source), target, calibration)


def fp32_export(source: ModelSource) -> Path:
    """The fp32 ONNX export of a checkpoint (cached; exported when the cache is cold)."""
    return _export_cached(source, source.source_hash())


def _export_cached(source: ModelSource, source_hash: str) -> Path:
    """Exports are slow (about a minute for SmolLM2): reuse one keyed by checkpoint and toolchain."""
    import torch
    import transformers

    key = f"{source_hash[:16]}-f{EXPORT_FORMAT}-torch{torch.__version__}-tf{transformers.__version__}"
    if source.pooling is not None:  # an encoder's graph ends in its pooling (its files are in source_hash too)
        pooled = json.dumps(source.pooling.to_json(source.info.hidden_size), sort_keys=True).encode()
        key += f"-pool{hashlib.sha256(pooled).hexdigest()[:8]}"
    folder = cache_root() / "onnx" / key

    def reuse(path: Path) -> Path | None:
        if (path / ONNX_FILE).is_file():
            say(f"export: reusing cached fp32 ONNX {path / ONNX_FILE}")
            return path / ONNX_FILE
        return None

    def export() -> Path:
        with atomic_dir(folder) as tmp:
            _export(source, tmp / ONNX_FILE)
        return folder / ONNX_FILE

    return build_once(folder, reuse, export)


def _export(source: ModelSource, path: Path) -> None:
    import onnx

    from trtserve.engine_builder.export import export_onnx
    from trtserve.memory import return_freed_memory
    from trtserve.models.loading import load_torch_model

    with step(f"loading {source.model_id} in torch fp32"):
        model = load_torch_model(source)
    with step("exporting to ONNX"):
        export_onnx(source, model, path)
    del model
    gc.collect()  # the exported model's cycles: the next step loads the reference, never beside this copy
    return_freed_memory()  # and its pages go back to the system, not kept by the heap for this process
    with step("checking the graph with onnx.checker"):
        onnx.checker.check_model(str(path), full_check=True)


def _copy_tokenizer_files(source: ModelSource, tmp: Path) -> None:
    for file in source.files():
        if file.suffix not in WEIGHT_SUFFIXES and file.suffix in (".json", ".txt", ".jinja", ".model"):
            shutil.copyfile(file, tmp / file.name)


def _opset(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _io_from_graph(path: Path) -> dict:
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = onnx.load(str(path), load_external_data=False).graph

    def spec(value):
        tensor = value.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in tensor.shape.dim]
        return {"name": value.name, "dtype": tensor_dtype_to_np_dtype(tensor.elem_type).name, "shape": shape}

    return {"inputs": [spec(v) for v in graph.input], "outputs": [spec(v) for v in graph.output]}


def _shape_ranges(source: ModelSource, max_batch: int, max_seq: int) -> dict:
    opt_seq = min(OPT_SEQ, max_seq)
    ranges = {
        "batch": {"min": 1, "opt": 1, "max": max_batch},
        "sequence": {"min": 1, "opt": opt_seq, "max": max_seq},
    }
    if source.info.kind == ModelKind.DECODER:
        ranges["past_sequence"] = {"min": 0, "opt": min(OPT_SEQ, max_seq - 1), "max": max_seq - 1}
        ranges["total_sequence"] = {"min": 1, "opt": opt_seq, "max": max_seq}
        ranges["logit_positions"] = {"min": 1, "opt": 1, "max": max_seq}
    return ranges


def _versions() -> dict:
    import numpy
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {
        "trtserve": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": numpy.__version__,
        "machine": f"{platform.system()} {platform.machine()}",
    }


def _rebuild_command(cfg: BuildConfig) -> str:
    parts = ["trtserve build-engine", cfg.model, "--out", str(cfg.out), "--precision", cfg.precision]
    if cfg.backend != "auto":
        parts += ["--backend", cfg.backend]
    parts += ["--max-batch", str(cfg.max_batch)]
    if cfg.max_seq is not None:
        parts += ["--max-seq", str(cfg.max_seq)]
    if cfg.calibration is not None:
        parts += ["--calibration", str(cfg.calibration)]
    if cfg.fidelity_target is not None:
        parts += ["--fidelity-target", cfg.fidelity_target.text()]
    if cfg.allow_low_fidelity:
        parts.append("--allow-low-fidelity")
    if cfg.confirm_grid:
        parts += ["--confirm-grid", cfg.confirm_grid]
    return " ".join(parts)

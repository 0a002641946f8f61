"""build-engine: checkpoint -> ONNX -> backend artifact -> parity -> engine dir (atomic)."""

from __future__ import annotations

import platform
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trtserve import __version__, engine_dir
from trtserve.engine_builder.tensorrt import TrtOptions
from trtserve.errors import TrtServeError
from trtserve.fileio import atomic_dir, cache_root, check_writable_target, sha256_file
from trtserve.models.sources import BUNDLED, WEIGHT_SUFFIXES, ModelSource, resolve
from trtserve.precision.measure import Target
from trtserve.precision.policy import POLICIES, get_policy
from trtserve.progress import say, step

ONNX_FILE = "model.onnx"
EXPORT_FORMAT = 2  # bump when the exported graph contract changes: invalidates the ONNX cache
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
    if cfg.precision not in POLICIES:
        raise TrtServeError(f"--precision {cfg.precision} is not available; choose one of {', '.join(POLICIES)}")
    if cfg.calibration is not None and not Path(cfg.calibration).is_file():
        raise TrtServeError(f"--calibration {cfg.calibration} is not a readable file: give a UTF-8 text file")
    if cfg.max_batch < 1:
        raise TrtServeError(f"--max-batch must be at least 1, got {cfg.max_batch}")
    check_writable_target(cfg.out)
    from trtserve.runtime.devices import choose_backend

    backend, why = choose_backend(cfg.backend)
    if backend == "tensorrt":
        from trtserve.runtime.trt_lib import load_tensorrt

        trt, flavour = load_tensorrt()  # before the long export: a missing library is a quick, clear error
        if flavour == "tensorrt_rtx":
            from trtserve.engine_builder.tensorrt import rtx_targets

            rtx_targets(trt, cfg.trt.compute_capabilities)
        why += f"; {flavour} {trt.__version__}"
    say(f"backend: {backend} ({why})")
    source = resolve(cfg.model)
    if get_policy(cfg.precision).weights == "gguf" and source.gguf is None:
        raise TrtServeError(f"--precision gguf reads a GGUF checkpoint's own blocks, and {source.model_id} was not "
                            "converted from a .gguf file; give the .gguf file, or choose another --precision")
    max_seq = _max_seq(cfg, source)
    grid = None
    if cfg.confirm_grid:  # checked before the long export: a bad grid is a quick, clear error
        from trtserve.precision.measure import grid_shapes

        grid = grid_shapes(cfg.confirm_grid, cfg.confirm_shapes, cfg.confirm_seed, source.model_id, cfg.max_batch,
                           max_seq)
    started = time.time()
    with atomic_dir(cfg.out) as tmp:
        manifest = _build_into(tmp, cfg, source, max_seq, backend, why, grid)
        manifest["build_seconds"] = round(time.time() - started, 1)
        engine_dir.seal(tmp, manifest)
    return engine_dir.open_engine_dir(cfg.out, verify=False)


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


def _build_into(tmp: Path, cfg: BuildConfig, source: ModelSource, max_seq: int, backend: str, why: str,
                grid=None) -> dict:
    from trtserve.engine_builder.onnxruntime import OPTIMIZED, map_weights, resident_mb, share_weights
    from trtserve.precision.run import Harness

    onnx_path = tmp / ONNX_FILE
    source_hash = source.source_hash()
    fp32_graph = _export_cached(source, source_hash)
    manifest = {
        "model": {
            "id": source.model_id,
            "source": cfg.model if cfg.model in BUNDLED and not Path(cfg.model).exists()
            else str(source.gguf or source.path),
            "source_path": str(source.path),
            "source_sha256": source_hash,
            "family": source.info.family,
            "kind": source.info.kind,
            "architecture": vars(source.info),
        },
        "io": _io_from_graph(fp32_graph),  # the policy keeps graph inputs and outputs fp32
        "shapes": _shape_ranges(source, cfg.max_batch, max_seq),
    }
    policy = get_policy(cfg.precision)
    target = cfg.fidelity_target or (Target.parity() if policy.name == "fp32"
                                     else Target.for_weights(policy.weights, source.info.kind))
    harness = Harness(engine_dir.EngineDir(tmp, manifest), source, target, cfg.calibration)
    harness.grid_shapes = grid or []
    _copy_tokenizer_files(source, tmp)  # before any measurement: --confirm-grid's real-text rows are tokenized from it
    search_record = None
    if policy.name == "auto":
        import onnx

        from trtserve.precision.search import search

        with step("auto precision: overflow probe and search under fp16 emulation"):
            policy, search_record = search(onnx.load(str(fp32_graph)), harness)
    manifest.update({"versions": _versions(), "build_command": _rebuild_command(cfg)})
    if grid:  # the gate's cases from it are labelled "<label> <input> b<batch> seq<length>"
        manifest["confirm_grid"] = {"grid": cfg.confirm_grid, "label": grid[0][0], "shapes": len(grid)}
    report = _precision_and_ort(tmp, manifest, policy, search_record, source, fp32_graph, target, harness, why)
    manifest["backend"]["weights"] = map_weights(tmp / OPTIMIZED)
    manifest["backend"]["resident_mb"] = resident_mb(tmp / OPTIMIZED)  # of the chosen graph only
    if source.info.kind == "decoder":
        from trtserve.engine_builder.kv_graph import build_kv

        with step("writing the decode graph (attention over in-place KV buffers) and checking it"):
            kv = manifest["backend"]["kv_graph"] = build_kv(tmp, manifest)
        if kv["file"]:
            map_weights(tmp / kv["file"])
            kv["weights"] = share_weights(tmp / OPTIMIZED, tmp / kv["file"])  # one copy of what both hold
        else:
            say(f"no decode graph: {kv['why_not']}; decoding copies the cache per step")
    if backend == "tensorrt":  # the ONNX Runtime graph stays beside the plan: the CPU fallback
        from trtserve.engine_builder.tensorrt import build_trt

        with step("building the TensorRT plan"):
            manifest["tensorrt"] = build_trt(onnx_path, tmp, manifest, cfg.trt)
        manifest["tensorrt"]["chosen_because"] = why
    manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest["fidelity"] = report
    if not report["passed"] and not cfg.allow_low_fidelity:
        first = "; ".join(report["failures"][:3])
        raise TrtServeError(
            f"the {policy.name} engine misses the fidelity target ({len(report['failures'])} failures, e.g. {first}); "
            "nothing was written. Use --precision hybrid or fp32, relax --fidelity-target, "
            "or pass --allow-low-fidelity to keep it anyway"
        )
    return manifest


def _precision_and_ort(tmp: Path, manifest: dict, policy, search_record, source, fp32_graph: Path, target,
                       harness, why: str) -> dict:
    """Write the policy into the graph, optimize it for ONNX Runtime, measure it; return the fidelity report.

    Quantized policies try the activation plans (precision.activations) fastest first. A plan whose quick
    screen passes is measured in full; where that misses, int8 and int4 keep more of their most sensitive
    weights one step safer (track_quant.escalation: the calibration text is shorter than the gate's shapes)
    before the next plan is tried. The first engine that meets the target is kept; the tries that missed
    are recorded in the backend entry."""
    from trtserve.engine_builder.onnxruntime import build_ort
    from trtserve.precision.run import measure_engine, screen_summary, summary
    from trtserve.precision.search import SEARCH_MAX_LENGTH
    from trtserve.precision.sensitivity import widened

    onnx_path = tmp / ONNX_FILE
    plans, tried, written, blocks = [None], [], None, None
    if policy.weights != "float":
        import onnx

        from trtserve.precision.activations import plans as activation_plans

        plans = activation_plans(onnx.load(str(fp32_graph)))
        blocks = _weight_blocks(policy, source, fp32_graph, harness, target)  # once, for every plan
    measured = policy.weights not in ("float", "gguf")  # each weight's format chosen here: it can be widened
    for plan in plans:
        measured_digest = None
        keep = (plan.fp32_weights if policy.weights == "gguf" else plan.int8) if plan else frozenset()
        counts = _widening(blocks, policy.weights) if measured else [None]
        for number, kept in enumerate(counts):
            chosen = widened(blocks, kept) if measured and kept > blocks.kept else blocks
            if (keep, kept) != written:
                graph_report = _apply_precision(fp32_graph, policy, onnx_path, source, keep, chosen)
                written, digest = (keep, kept), sha256_file(onnx_path)
                if number and digest == measured_digest:  # the plan keeps those GEMMs fp32 anyway: same graph
                    say(f"keeping the {kept} most sensitive weights safer changes no weight under this plan")
                    continue
                measured_digest = digest
            label = f", int8 activations in {plan.label}" if plan else ""
            label += f", the {kept} most sensitive weights kept safer" if kept is not None and kept > blocks.kept else ""
            with step(f"optimizing the graph with ONNX Runtime{label}"):
                backend_entry = build_ort(onnx_path, tmp, plan.int8 if plan else None)
            backend_entry["chosen_because"] = why
            if plan:
                backend_entry.update(int8_activations=plan.label, int8_activations_missed=list(tried))
            manifest.update({
                "onnx": {"file": ONNX_FILE, "sha256": digest, "opset": _opset(onnx_path),
                         "exporter": "torch.onnx.export(dynamo=True)", "fp32_export_cache": str(fp32_graph)},
                "precision": dict(policy.describe(), graph=graph_report, search=search_record),
                "backend": backend_entry,
            })
            if plan is not plans[-1] and number == 0:  # a quick screen first: prefill only, shorter lengths
                harness.engine = engine_dir.EngineDir(tmp, manifest)
                short = [n for n in harness.lengths if n <= SEARCH_MAX_LENGTH]
                with step(f"screening int8 activations in {plan.label}"):
                    screen = harness.run(decode=False, lengths=short, wide=False)
                if not screen["passed"]:
                    tried.append({"plan": plan.label, "fidelity": screen_summary(screen, short, harness.corpus.name)})
                    say(f"int8 activations in {plan.label} miss the target: {tried[-1]['fidelity']}")
                    break
            report = measure_engine(engine_dir.EngineDir(tmp, manifest), source, fp32_graph, target, harness=harness)
            if report["passed"] or (plan is plans[-1] and number == len(counts) - 1):
                return report
            tried.append({"plan": plan.label, "fidelity": summary(report),
                          **({"kept_safer": kept} if measured else {})})
            say(f"int8 activations in {plan.label}"
                + (f" with the {kept} most sensitive weights kept safer" if measured else "")
                + f" miss the target: {summary(report)}")
    return report


def _widening(choice, fmt: str) -> list[int]:
    """How many of the most sensitive weights a plan tries keeping safer, in order (track_quant.escalation):
    only counts that move a weight whose quantization alone changed the output (weights already on their
    format's grid, as SmolLM2's on Q4_1's, measure 0 and gain nothing), and only while some weight keeps the
    policy's own format (past that the engine would be another policy's)."""
    from trtserve.precision.sensitivity import widened
    from trtserve.precision.track_quant import escalation

    effective = sum(value > 0 for value in choice.sensitivity.values())  # ranked first
    counts = [choice.kept]
    for kept in escalation(choice.kept, len(choice.sensitivity))[1:]:
        if counts[-1] >= effective or fmt not in widened(choice, kept).formats.values():
            break
        counts.append(kept)
    return counts


def _weight_blocks(policy, source: ModelSource, fp32_graph: Path, harness, target):
    """What a quantized-weight policy writes from: the GGUF file's blocks, or each weight's measured format."""
    import onnx

    if policy.weights == "gguf":
        from trtserve.precision.gguf_blocks import BlockIndex, read_blocks

        return BlockIndex(read_blocks(source.gguf))
    from trtserve.precision.quant_policy import candidates
    from trtserve.precision.sensitivity import CALIBRATION_LENGTH, CALIBRATION_ROWS, choose

    weights, eight_bit = candidates(onnx.load(str(fp32_graph)))
    try:
        rows = harness.corpus.rows(harness.tokenizer, CALIBRATION_ROWS, CALIBRATION_LENGTH,
                                   special=source.info.kind == "encoder")
    except ValueError as exc:
        raise TrtServeError(f"--calibration: {exc}; the {policy.name} policy measures each weight's sensitivity on "
                            f"{CALIBRATION_ROWS} rows of {CALIBRATION_LENGTH} tokens") from None
    with step(f"{policy.name} weights: sensitivity of {len(weights)} weights on {harness.corpus.name}, then the mix"):
        return choose(harness.reference, source.info.kind, weights, eight_bit, policy.weights, target, rows,
                      cache_dir=cache_root() / "sensitivity")


def _apply_precision(fp32_graph: Path, policy, out: Path, source: ModelSource, keep: frozenset = frozenset(),
                     blocks=None) -> dict:
    import onnx

    from trtserve.precision.passes import apply_policy

    if policy.name == "fp32":
        shutil.copyfile(fp32_graph, out)
        return {}
    if policy.weights != "float":
        return _apply_blocked(fp32_graph, out, policy, source, keep, blocks)
    with step(f"writing the {policy.name} precision policy into the graph"):
        mixed, report = apply_policy(onnx.load(str(fp32_graph)), policy)
        onnx.save(mixed, str(out))
        onnx.checker.check_model(str(out), full_check=True)
    say(f"precision: {policy.name}: {sum(report.low_nodes.values())} nodes low, "
        f"{sum(report.fp32_nodes.values())} fp32, {report.casts_inserted} casts, patterns kept fp32: "
        + (", ".join(f"{k} x{v['instances']}" for k, v in report.patterns.items()) or "none (explicit node set)"))
    return report.to_json()


def _apply_blocked(fp32_graph: Path, out: Path, policy, source: ModelSource, keep: frozenset, blocks) -> dict:
    """Write a quantized-weight policy (gguf: `blocks` is the file's index, `keep` the GEMMs kept fp32;
    int8/int4: `blocks` is the measured choice, `keep` the plan's int8-activation GEMMs)."""
    import onnx

    if policy.weights == "gguf":
        from trtserve.precision.gguf_policy import apply_gguf

        label = f"carrying the blocks of {source.gguf.name} into the graph"
        rewrite = lambda model: apply_gguf(model, source.gguf, keep, blocks)  # noqa: E731
    else:
        from trtserve.precision.quant_policy import apply_quantized

        label = f"writing {policy.name} weights into the graph"
        rewrite = lambda model: apply_quantized(model, blocks, keep)  # noqa: E731
    with step(label):
        model, report = rewrite(onnx.load(str(fp32_graph)))
        onnx.save(model, str(out))
        onnx.checker.check_model(str(out), full_check=True)
    formats = ", ".join(f"{k} x{v}" for k, v in sorted(Counter(
        v["format"] for v in [*report["gemms"].values(), *report["embeddings"].values()]).items()))
    if policy.weights == "gguf":
        say(f"precision: gguf: {len(report['gemms'])} GEMMs and {len(report['embeddings'])} embeddings read GGUF "
            f"blocks ({formats}), {len(report['fp32'])} weights stay fp32")
    else:
        say(f"precision: {policy.name}: {formats}, {len(report['fp32'])} weights fp32")
    return report


def remeasure(engine: engine_dir.EngineDir, calibration=None) -> dict:
    """`trtserve fidelity`: measure an existing engine again against its fp32 export, on any text."""
    from trtserve.precision.run import measure_engine

    source = resolve(engine.manifest.model.source)
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
    cached = cache_root() / "onnx" / key / ONNX_FILE
    if cached.is_file():
        say(f"export: reusing cached fp32 ONNX {cached}")
    else:
        cached.parent.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(cached.parent) as tmp:
            _export(source, tmp / ONNX_FILE)
    return cached


def _export(source: ModelSource, path: Path) -> None:
    import onnx

    from trtserve.engine_builder.export import export_onnx
    from trtserve.models.loading import load_torch_model

    with step(f"loading {source.model_id} in torch fp32"):
        model = load_torch_model(source)
    with step("exporting to ONNX"):
        export_onnx(source, model, path)
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
    if source.info.kind == "decoder":
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

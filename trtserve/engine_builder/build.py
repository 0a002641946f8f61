"""build-engine: checkpoint -> ONNX -> backend artifact -> parity -> engine dir (atomic)."""

from __future__ import annotations

import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from trtserve import __version__
from trtserve.engine_builder import artifact
from trtserve.errors import TrtServeError
from trtserve.fileio import atomic_dir, check_writable_target, sha256_file
from trtserve.models.sources import BUNDLED, WEIGHT_SUFFIXES, ModelSource, cache_root, resolve
from trtserve.precision.policy import POLICIES, describe
from trtserve.progress import say, step

ONNX_FILE = "model.onnx"
EXPORT_FORMAT = 1  # bump when the exported graph contract changes: invalidates the ONNX cache
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


def build_engine(cfg: BuildConfig) -> artifact.EngineDir:
    if cfg.precision not in POLICIES:
        raise TrtServeError(f"--precision {cfg.precision} is not available; choose one of {', '.join(POLICIES)}")
    if cfg.max_batch < 1:
        raise TrtServeError(f"--max-batch must be at least 1, got {cfg.max_batch}")
    check_writable_target(cfg.out)
    from trtserve.runtime.devices import choose_backend

    backend, why = choose_backend(cfg.backend)
    say(f"backend: {backend} ({why})")
    source = resolve(cfg.model)
    max_seq = _max_seq(cfg, source)
    started = time.time()
    with atomic_dir(cfg.out) as tmp:
        manifest = _build_into(tmp, cfg, source, max_seq, backend, why)
        manifest["build_seconds"] = round(time.time() - started, 1)
        manifest["files"] = {
            p.name: artifact.file_entry(p) for p in sorted(tmp.iterdir()) if p.name != artifact.MANIFEST
        }
        artifact.write_manifest(tmp, manifest)
    return artifact.open_engine_dir(cfg.out, verify=False)


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


def _build_into(tmp: Path, cfg: BuildConfig, source: ModelSource, max_seq: int, backend: str, why: str) -> dict:
    from trtserve.engine_builder.onnxruntime import build_ort

    onnx_path = tmp / ONNX_FILE
    source_hash = source.source_hash()
    _export_cached(source, source_hash, onnx_path)
    _copy_tokenizer_files(source, tmp)
    with step("optimizing the graph with ONNX Runtime"):
        backend_entry = build_ort(onnx_path, tmp)
    backend_entry["chosen_because"] = why
    manifest = {
        "model": {
            "id": source.model_id,
            "source": source.model_id if source.model_id in BUNDLED else str(source.path),
            "source_path": str(source.path),
            "source_sha256": source_hash,
            "family": source.info.family,
            "kind": source.info.kind,
            "architecture": vars(source.info),
        },
        "onnx": {"file": ONNX_FILE, "sha256": sha256_file(onnx_path), "opset": _opset(onnx_path),
                 "exporter": "torch.onnx.export(dynamo=True)"},
        "io": _io_from_graph(onnx_path),
        "shapes": _shape_ranges(source, cfg.max_batch, max_seq),
        "precision": describe(cfg.precision),
        "backend": backend_entry,
        "versions": _versions(),
        "build_command": _rebuild_command(cfg),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    manifest["parity"] = _parity(tmp, manifest, source, max_seq)
    return manifest


def _export_cached(source: ModelSource, source_hash: str, onnx_path: Path) -> None:
    """Exports are slow (about a minute for SmolLM2): reuse one keyed by checkpoint and toolchain."""
    import torch
    import transformers

    key = f"{source_hash[:16]}-f{EXPORT_FORMAT}-torch{torch.__version__}-tf{transformers.__version__}"
    cached = cache_root() / "onnx" / key / ONNX_FILE
    if cached.is_file():
        say(f"export: reusing cached ONNX {cached}")
    else:
        cached.parent.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(cached.parent) as tmp:
            _export(source, tmp / ONNX_FILE)
    shutil.copyfile(cached, onnx_path)


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
    return ranges


def _parity(tmp: Path, manifest: dict, source: ModelSource, max_seq: int) -> dict:
    from trtserve.engine_builder.parity import decoder_parity, encoder_parity
    from trtserve.models.loading import load_tokenizer, load_torch_model
    from trtserve.runtime.ort import OrtBackend

    with step("parity against torch fp32 on Wikipedia text"):
        backend = OrtBackend(artifact.EngineDir(tmp, manifest))
        reference = load_torch_model(source, attention="eager")
        tokenizer = load_tokenizer(source.path)
        check = encoder_parity if source.info.kind == "encoder" else decoder_parity
        report = check(backend, reference, tokenizer, max_seq)
        backend.close()
    say(f"parity: {'passed' if report['passed'] else 'FAILED'} {summary(report)}")
    return report


def summary(parity: dict) -> str:
    if "prefill" in parity:
        pre, dec = parity["prefill"], parity["decode"]
        return (
            f"prefill top-1 {pre['top1_agreement']:.2%}, perplexity {pre['perplexity_torch']:.3f} (torch) vs "
            f"{pre['perplexity_engine']:.3f} (engine), delta {pre['perplexity_rel_delta']:.2e}; "
            f"decode {dec['steps']} steps top-1 {dec['top1_agreement']:.2%}, "
            f"max abs error {dec['logits']['max_abs_error']:.2e}"
        )
    return f"max abs error {parity['max_abs_error']:.2e} (threshold {parity['threshold']['max_abs_error']:.0e})"


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
    parts += ["--max-batch", str(cfg.max_batch)]
    if cfg.max_seq is not None:
        parts += ["--max-seq", str(cfg.max_seq)]
    return " ".join(parts)

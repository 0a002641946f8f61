"""First-start engines: serve an engine dir as given, or build one for this machine once and reuse it.

A built engine is keyed by the checkpoint's content (a changed checkpoint gets a new engine, never
the old one) and by its target, since a TensorRT plan is tied to the GPU model and the TensorRT
version that built it: `<model>-<content hash>-<precision>-onnxruntime-b<builder>` on the CPU
(`...-onnxruntime-openvino<version>-cpu<hash>-...` where OpenVINO is installed, which an encoder's build measures
on this CPU; `...-openvino<version>-cpu<hash>-...` with --backend openvino),
`<model>-<content hash>-<precision>-<flavour><version>-<gpu>-sm<cc>-b<builder>` on a GPU, where
`<builder>` is a digest of the builder's sources (fileio.build_code_digest). Several processes starting at once on
one volume (replicas, containers) take a lock so that one builds and the others reuse its result.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from trtserve.errors import TrtServeError


def target_key(backend: str, requested: str = "auto") -> str:
    """What an engine built here by `backend` (`requested` resolved) is tied to, as a directory-name fragment.
    An encoder's OpenVINO part, measured under auto where the package is installed or with --backend openvino,
    is tied to the OpenVINO version and this CPU (its precisions and timings are this CPU's)."""
    from trtserve.runtime.openvino import installed

    if backend == "openvino" or (backend == "onnxruntime" and requested == "auto" and installed()):
        from hashlib import sha256
        from importlib.metadata import version

        from trtserve.engine_builder.openvino import cpu_description

        cpu = sha256(cpu_description().encode()).hexdigest()[:8]
        return f"{'openvino' if backend == 'openvino' else 'onnxruntime-openvino'}{version('openvino')}-cpu{cpu}"
    if backend != "tensorrt":
        return "onnxruntime"
    from trtserve.runtime.devices import cuda_device_info
    from trtserve.runtime.trt_lib import load_tensorrt

    trt, flavour = load_tensorrt()
    devices = cuda_device_info()
    gpu = f"{_slug(devices[0]['name'])}-sm{devices[0]['compute_capability'].replace('.', '')}" if devices else "nogpu"
    return f"{flavour.replace('_', '-')}{trt.__version__}-{gpu}"


def content_key(model: str) -> str:
    """The first 12 hex digits of the sha256 over the checkpoint's files (names and contents)."""
    from trtserve.fileio import sha256_files

    path = Path(model)
    if not path.is_dir():  # a bundled model's name: its checkpoint as the builder will read it
        from trtserve.models.sources import resolve

        path = resolve(model).path
    files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
    return sha256_files(files, path)[:12]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def engines_root() -> Path:
    from trtserve.fileio import cache_root

    return cache_root() / "engines"


def engine_for(model: str, precision: str = "fp32", backend: str = "auto", root: Path | None = None) -> Path:
    """MODEL if it is an engine dir; else this machine's engine for MODEL under ROOT, built on first use."""
    from trtserve.engine_dir import MANIFEST, open_engine_dir, whole_engine_dir

    if (Path(model) / MANIFEST).is_file():
        open_engine_dir(model)  # a damaged engine is one clear error here, not a failed server start
        return Path(model)
    if Path(model).is_dir() and not any(Path(model).iterdir()):
        raise TrtServeError(f"{model} is an empty directory: mount a checkpoint or an engine directory there, "
                            "or name a bundled model (all-MiniLM-L6-v2, SmolLM2-135M-Instruct)")
    from trtserve.engine_builder.build import BuildConfig, backend_for, build_engine

    chosen, why = backend_for(model, backend)
    root = engines_root() if root is None else Path(root)
    from trtserve.fileio import build_code_digest, build_once

    # the builder's code too: an upgraded trtserve builds its own engine instead of serving an older build's
    target = root / (f"{Path(model).name}-{content_key(model)}-{precision}-{target_key(chosen, backend)}"
                     f"-b{build_code_digest()[:8]}")

    def reuse(path: Path):
        engine = whole_engine_dir(path)
        if engine is not None:
            print(f"using the engine built earlier for this machine: {path}", file=sys.stderr)
        return engine

    def build():
        print(f"building the {precision} engine of {model} for this machine into {target} (once; {why})",
              file=sys.stderr)
        # auto stays auto on the CPU: an encoder's build then measures OpenVINO too (engine_builder/openvino.py)
        build_backend = backend if (backend, chosen) == ("auto", "onnxruntime") else chosen
        return build_engine(BuildConfig(model=model, out=target, precision=precision, backend=build_backend))

    return build_once(target, reuse, build).path


def split_name(model: str) -> tuple[str | None, str]:
    """NAME=MODEL as (NAME, MODEL); a plain MODEL (or a path that exists with "=" in it) as (None, MODEL)."""
    name, sep, rest = model.partition("=")
    if sep and name and "/" not in name and not Path(model).exists():
        return name, rest
    return None, model


def repository_folders(repository: str | None) -> list[Path]:
    """The engine directories of a model repository (its subfolders; hidden ones skipped)."""
    from trtserve.engine_dir import MANIFEST

    if repository is None:
        return []
    root = Path(repository)
    if not root.is_dir():
        raise TrtServeError(f"--model-repository {repository} is not a directory")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    strays = [p.name for p in folders if not (p / MANIFEST).is_file()]
    if strays:
        raise TrtServeError(f"--model-repository {repository}: {', '.join(strays)} hold no {MANIFEST}; every "
                            "subfolder must be an engine directory (build one with `trtserve build-engine`)")
    if not folders:
        raise TrtServeError(f"--model-repository {repository} has no engine directories")
    return folders


def served_engines(models: list[str], repository: str | None = None, precision: str = "fp32",
                   backend: str = "auto") -> list[tuple[str | None, Path]]:
    """(model name or None, engine dir) for each MODEL (an engine dir or a model, optionally as NAME=MODEL;
    without a name, served under its manifest's model id) and each engine dir in REPOSITORY (served under
    its folder's name, as in a Triton model repository). Models are built on first use (engine_for)."""
    named = [split_name(m) for m in models] + [(p.name, str(p)) for p in repository_folders(repository)]
    return [(name, engine_for(model, precision, backend)) for name, model in named]

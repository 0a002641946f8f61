"""The engine directory, the contract between building and serving: manifest.json plus model
files. The builder writes one (`seal` in a temp dir that `fileio.atomic_dir` puts in place);
the runtime, the server, eval and deploy open it (`open_engine_dir`) and read its typed manifest
(`manifest.Manifest`). This package imports no other package of trtserve but errors and fileio.

Every file the manifest lists carries its size and sha256; loading checks them before any
backend sees a byte, so a missing, truncated or swapped file is a clear error with the
command that rebuilds the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trtserve.engine_dir.kinds import ModelKind
from trtserve.engine_dir.manifest import FileEntry, Manifest
from trtserve.errors import EngineDirError
from trtserve.fileio import sha256_file

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class EngineDir:
    """An engine directory and its manifest (typed; a builder's dict being composed is validated here)."""

    path: Path
    manifest: Manifest

    def __post_init__(self) -> None:
        object.__setattr__(self, "manifest", as_manifest(self.manifest))

    @property
    def kind(self) -> ModelKind:
        return self.manifest.model.kind

    @property
    def rebuild(self) -> str:
        return self.manifest.build_command or f"trtserve build-engine MODEL --out {self.path}"

    def file(self, name: str) -> Path:
        return self.path / name


def file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def as_manifest(manifest: Manifest | dict[str, Any]) -> Manifest:
    """The typed manifest of a dict the builder composed (a schema error there is a bug: it raises)."""
    return manifest if isinstance(manifest, Manifest) else Manifest.model_validate(manifest)


def write_manifest(directory: Path, manifest: Manifest | dict[str, Any]) -> None:
    manifest = dict(as_manifest(manifest).to_json(), schema_version=SCHEMA_VERSION)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def seal(directory: Path, manifest: Manifest | dict[str, Any]) -> EngineDir:
    """Finish an engine dir being written: list every file in it (size, sha256), then write the manifest."""
    files = {p.name: file_entry(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = as_manifest(dict(as_manifest(manifest).to_json(), files=files))
    write_manifest(directory, manifest)
    return EngineDir(directory, manifest)


def read_manifest(path: Path) -> Manifest:
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise EngineDirError(
            f"{path} is not an engine directory: build one with `trtserve build-engine MODEL --out {path}`"
        )
    if not manifest_path.is_file():
        raise EngineDirError(
            f"{path} has no {MANIFEST}: it is not a complete engine; rebuild it with "
            f"`trtserve build-engine MODEL --out {path}`"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineDirError(
            f"{manifest_path} is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc}): rebuild the engine with "
            f"`trtserve build-engine MODEL --out {path}`"
        ) from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise EngineDirError(
            f"{manifest_path} has schema version {version}, this trtserve reads {SCHEMA_VERSION}: rebuild with "
            f"`{manifest.get('build_command') or 'trtserve build-engine MODEL --out ' + str(path)}`"
        )
    try:
        return Manifest.model_validate(manifest)
    except ValidationError as exc:
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
        raise EngineDirError(
            f"{manifest_path} does not follow the manifest schema ({where}): rebuild with "
            f"`{manifest.get('build_command') or 'trtserve build-engine MODEL --out ' + str(path)}`"
        ) from None


def open_engine_dir(path: str | Path, verify: bool = True) -> EngineDir:
    """Read and (by default) verify an engine dir; raise EngineDirError naming the fix."""
    path = Path(path)
    engine = EngineDir(path=path, manifest=read_manifest(path))
    if verify:
        for name, entry in engine.manifest.files.items():
            _verify_file(engine, name, entry)
    return engine


def whole_engine_dir(path: str | Path) -> EngineDir | None:
    """The engine dir at `path` when it is there and whole (manifest and files checked); None when it must be
    built (again): what a cache of built engines reuses."""
    try:
        return open_engine_dir(path)
    except EngineDirError:
        return None


def _verify_file(engine: EngineDir, name: str, entry: FileEntry) -> None:
    path = engine.file(name)
    fix = f"rebuild the engine with `{engine.rebuild}`"
    if not path.is_file():
        raise EngineDirError(f"{path} is missing from the engine directory: {fix}")
    size = path.stat().st_size
    if size != entry.size:
        raise EngineDirError(f"{path} has {size} bytes, the manifest says {entry.size} (truncated or replaced): {fix}")
    if sha256_file(path) != entry.sha256:
        raise EngineDirError(f"{path} does not match the sha256 in the manifest (corrupt or replaced): {fix}")

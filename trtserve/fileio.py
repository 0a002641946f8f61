"""Hashing, the cache root and atomic directory writes shared by model caches and engine dirs."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from trtserve.errors import TrtServeError


def cache_root() -> Path:
    """Where converted checkpoints, exports, sensitivity tables and timing caches are kept ($TRTSERVE_CACHE)."""
    return Path(os.environ.get("TRTSERVE_CACHE", Path.home() / ".cache" / "trtserve"))


BUILD_CODE = ("engine_builder", "precision", "models", "data", "engine_dir")  # what decides an engine's files


def build_code_digest(root: Path | None = None) -> str:
    """sha256 over the sources that build an engine (under `root`, the package by default): a cache of built
    engines keyed by it is never reused by a trtserve whose builder writes something else (a new manifest
    field, another policy)."""
    root = Path(__file__).parent if root is None else Path(root)
    files: list[Path] = []
    for path in (root / name for name in BUILD_CODE):
        files += [path] if path.is_file() else path.rglob("*.py")
    return sha256_files(files, root)  # sorts them


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_files(paths: list[Path], root: Path) -> str:
    """One hash over several files, keyed by their names relative to root."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def check_writable_target(out: Path) -> None:
    """Fail early, before any expensive work, if `out` cannot become a directory."""
    parent = out.absolute().parent
    try:
        if out.exists() and not out.is_dir():
            raise TrtServeError(
                f"--out {out} is an existing file, not a directory: choose another path or remove the file"
            )
        parent.mkdir(parents=True, exist_ok=True)
        probe = parent / f".{out.name}.probe-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise TrtServeError(
            f"cannot write into {parent} ({exc.strerror or exc}): choose an --out in a writable directory "
            "or fix its permissions"
        ) from None


@contextmanager
def atomic_dir(final: Path):
    """Yield a temp dir beside `final`; on success it replaces `final`, on any failure it is removed.

    The previous contents of `final` stay intact until the new directory is complete.
    """
    final = final.absolute()
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (created), held while the block runs: processes that start together on one
    volume (replicas, containers, test workers) wait for each other here."""
    import fcntl
    import sys

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building here ({path})", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(target: Path, reuse, build):
    """What is cached at `target`: `reuse(target)` when it is there and whole (None otherwise), else `build()`,
    which writes it (atomically). Under a lock beside it, so that processes starting together build it once
    and the others reuse it. The one build-or-reuse cache of exports, first-start engines and eval engines."""
    target = Path(target).absolute()
    with locked(target.parent / f".{target.name}.lock"):
        found = reuse(target)
        return found if found is not None else build()

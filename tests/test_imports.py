"""The CPU serving path needs no torch, no TensorRT and no transformers: the real server serves a
real encoder and a real decoder engine in processes where importing them raises (worker processes
included), and the package and its CLI import without them.

One module is torch code by nature and is only imported where torch is wanted: the
parallel-track model definition (models/pt_model.py)."""

import os
import pkgutil
import subprocess
import sys

import httpx
import pytest

import trtserve
from trtserve.testing.server import start_server, stop_server

BLOCKED = ("torch", "tensorrt", "tensorrt_rtx", "transformers", "onnxruntime")
SERVING_BLOCKED = ("torch", "tensorrt", "tensorrt_rtx", "transformers")
TORCH_BY_NATURE = ("trtserve.models.pt_model",)

SCRIPT = """
import importlib, pkgutil, sys
for name in {blocked!r}:
    sys.modules[name] = None  # any import of it now raises ImportError
import trtserve
names = [m.name for m in pkgutil.walk_packages(trtserve.__path__, "trtserve.")
         if not m.name.endswith("__main__") and m.name not in {torch_by_nature!r}]
for name in names:
    importlib.import_module(name)
heavy = [n for n in {blocked!r} if sys.modules.get(n) is not None]
print(len(names), heavy)
"""

# Loaded by every Python process started with this directory on PYTHONPATH, the server's spawned
# workers too: importing a blocked package (or any module inside it) raises ImportError.
SITECUSTOMIZE = """
import importlib.abc, sys
BLOCKED = {blocked!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: the serving path must not import it")
        return None

sys.meta_path.insert(0, Block())
"""


def test_every_module_imports_without_heavy_dependencies():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=BLOCKED, torch_by_nature=TORCH_BY_NATURE)],
        capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    count, heavy = result.stdout.split(" ", 1)
    expected = len([m for m in pkgutil.walk_packages(trtserve.__path__, "trtserve.")
                    if not m.name.endswith("__main__") and m.name not in TORCH_BY_NATURE])
    assert int(count) == expected and expected >= 20
    assert heavy.strip() == "[]"


def test_cli_help_runs_without_heavy_dependencies():
    script = f"import sys\nfor n in {BLOCKED!r}: sys.modules[n] = None\nfrom trtserve.cli import main\nmain(['--help'])"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "build-engine" in result.stdout


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("blocked")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=SERVING_BLOCKED))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    for name in SERVING_BLOCKED:  # the block works: each of them is installed here and fails to import there
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert probe.returncode != 0 and "is blocked" in probe.stderr, (name, probe.stderr[-500:])
    return env


@pytest.mark.models
def test_an_encoder_engine_is_served_without_torch_transformers_or_tensorrt(engines, blocked_env):
    proc, url = start_server(engines["minilm"], "--workers", "1", env=blocked_env)
    try:
        body = {"model": "all-MiniLM-L6-v2", "input": ["The cat sat on the mat.", "A dog barked."]}
        response = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
        assert response.status_code == 200, response.text
        vectors = [item["embedding"] for item in response.json()["data"]]
        assert len(vectors) == 2 and all(len(v) == 384 for v in vectors)
        assert httpx.get(f"{url}/health").json()["workers"][0]["pid"] != proc.pid  # a worker process answered
    finally:
        stop_server(proc)


@pytest.mark.models
def test_a_decoder_engine_is_served_without_torch_transformers_or_tensorrt(engines, blocked_env):
    proc, url = start_server(engines["smollm2"], "--workers", "1", env=blocked_env)
    try:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"].strip() and response.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{url}/health").json()["workers"][0]["pid"] != proc.pid
    finally:
        stop_server(proc)

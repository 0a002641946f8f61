"""The package and its CPU serving path import with no torch, no TensorRT and no transformers.

One module is torch code by nature and is only imported where torch is wanted: the
parallel-track model definition (models/pt_model.py)."""

import pkgutil
import subprocess
import sys

import trtserve

BLOCKED = ("torch", "tensorrt", "tensorrt_rtx", "transformers", "onnxruntime")
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


def test_every_module_imports_without_heavy_dependencies():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=BLOCKED, torch_by_nature=TORCH_BY_NATURE)], capture_output=True, text=True, timeout=120
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

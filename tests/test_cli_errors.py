"""Bad input to build-engine: one clear line, exit code 2, no partial engine dir."""

import json
import os
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.manifests import MODEL
from tests.test_sources import copy_checkpoint


def assert_clean_failure(result, out_parent, message):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    leftovers = [p.name for p in out_parent.iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers


def test_nonexistent_model_path(tmp_path):
    result = run_cli("build-engine", str(tmp_path / "missing"), "--out", str(tmp_path / "out"))
    assert_clean_failure(result, tmp_path, "does not exist")
    assert not (tmp_path / "out").exists()


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli("build-engine", str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert_clean_failure(result, tmp_path, "has no config.json")


def test_corrupt_safetensors(minilm_dir, tmp_path):
    bad = copy_checkpoint(minilm_dir, tmp_path / "m")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = run_cli("build-engine", str(bad), "--out", str(tmp_path / "out"))
    assert_clean_failure(result, tmp_path, "corrupt or truncated")
    assert not (tmp_path / "out").exists()


def test_missing_tokenizer(minilm_dir, tmp_path):
    bad = copy_checkpoint(minilm_dir, tmp_path / "m", skip=("tokenizer.json", "vocab.txt"))
    result = run_cli("build-engine", str(bad), "--out", str(tmp_path / "out"))
    assert_clean_failure(result, tmp_path, "has no tokenizer")


def test_max_seq_above_position_limit(minilm_dir, tmp_path):
    result = run_cli("build-engine", "all-MiniLM-L6-v2", "--out", str(tmp_path / "out"), "--max-seq", "4096")
    assert_clean_failure(result, tmp_path, "--max-seq 4096 is above all-MiniLM-L6-v2's position limit")
    assert "use --max-seq 512 or less" in result.stderr


@pytest.mark.parametrize("grid, message", [
    ("nope", "--confirm-grid nope: no preset 'nope': choose one of"),
    ("missing.toml", "--confirm-grid missing.toml: --grid missing.toml does not exist"),
    ("quick", "--confirm-grid quick: the grid has no shape for SmolLM2-135M-Instruct")])
def test_a_bad_confirm_grid_fails_before_the_export(tmp_path, grid, message):
    result = run_cli("build-engine", "SmolLM2-135M-Instruct", "--out", str(tmp_path / "out"), "--confirm-grid", grid)
    assert_clean_failure(result, tmp_path, message)
    assert "export" not in result.stderr and not (tmp_path / "out").exists()


def test_out_is_a_file(tmp_path):
    (tmp_path / "out").write_text("not a dir")
    result = run_cli("build-engine", "all-MiniLM-L6-v2", "--out", str(tmp_path / "out"))
    assert_clean_failure(result, tmp_path, "is an existing file, not a directory")
    assert (tmp_path / "out").read_text() == "not a dir"


def test_no_write_permission(tmp_path):
    if os.geteuid() == 0:
        # root ignores permission bits; sysfs refuses mkdir to everyone, root included
        parent = Path("/sys/fs/trtserve-no-write")
        if not Path("/sys/fs").is_dir():
            pytest.skip("running as root on a machine without /sys/fs: no directory that root cannot write")
        result = run_cli("build-engine", "all-MiniLM-L6-v2", "--out", str(parent / "out"))
        refusal = ("Operation not permitted", "Permission denied", "Read-only file system")
    else:
        parent = tmp_path / "locked"
        parent.mkdir(mode=0o555)
        result = run_cli("build-engine", "all-MiniLM-L6-v2", "--out", str(parent / "out"))
        refusal = ("Permission denied",)
    assert result.returncode == 2, result.stderr
    assert f"error: cannot write into {parent}" in result.stderr and "Traceback" not in result.stderr
    assert any(reason in result.stderr for reason in refusal), result.stderr
    assert not (parent / "out").exists()


def test_info_on_a_missing_engine(tmp_path):
    result = run_cli("info", str(tmp_path / "none"))
    assert_clean_failure(result, tmp_path, "is not an engine directory")


def test_info_on_a_damaged_engine(tmp_path):
    engine = tmp_path / "e"
    engine.mkdir()
    (engine / "manifest.json").write_text(json.dumps({"schema_version": 1, "model": MODEL,
                                                      "files": {"model.onnx": {"size": 1, "sha256": "0"}},
                                                      "build_command": "trtserve build-engine X --out e"}))
    result = run_cli("info", str(engine))
    assert_clean_failure(result, engine, "model.onnx is missing")
    assert "trtserve build-engine X --out e" in result.stderr


def _parser_running(func):
    import argparse

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=func)
    return parser


def test_interrupt_inside_a_native_import_exits_130(capsys):
    from trtserve.cli import _run

    def interrupted_import(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ImportError("initialization failed") from exc

    assert _run(_parser_running(interrupted_import), []) == 130
    assert "interrupted: nothing was written" in capsys.readouterr().err


def test_unexpected_exception_is_one_line_not_a_traceback(capsys, monkeypatch):
    from trtserve.cli import _run

    monkeypatch.delenv("TRTSERVE_DEBUG", raising=False)

    def broken(args):
        raise ValueError("boom")

    assert _run(_parser_running(broken), []) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unexpected ValueError: boom") and "TRTSERVE_DEBUG=1" in err
    monkeypatch.setenv("TRTSERVE_DEBUG", "1")
    with pytest.raises(ValueError):
        _run(_parser_running(broken), [])


@pytest.mark.parametrize(("module", "extra"), [("torch", "export"), ("fastapi", "serve"), ("ray.serve", "ray")])
def test_a_command_whose_extra_is_missing_names_the_extra_to_install(module, extra, capsys):
    import argparse

    from trtserve.cli import _run

    def needs(args):
        raise ModuleNotFoundError(f"No module named '{module}'", name=module)

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=needs, command="build-engine")
    assert _run(parser, []) == 2
    assert f"`trtserve build-engine` needs {module}, which is not installed: pip install 'trtserve[{extra}]'" in \
        capsys.readouterr().err


def test_version():
    from trtserve import __version__

    result = run_cli("--version", timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"trtserve {__version__}"

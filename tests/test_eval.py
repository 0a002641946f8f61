"""The evaluation grid: presets and grid files, a real quick run whose report is checked for
internal consistency, resuming, Ctrl-C, and regenerating the report from the JSON lines."""

import json
import math
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_cli
from trtserve.errors import TrtServeError
from trtserve.eval.grid import MIXED, load_grid


def test_presets_expand_to_the_promised_sizes():
    paper = load_grid(preset="paper").configs()
    runnable_here = [c for c in paper if c.backend != "tensorrt"]
    assert len(runnable_here) >= 480 and len({c.key for c in paper}) == len(paper)
    assert not any(c.backend == "torch" and c.precision != "fp32" for c in paper)
    assert not any(c.backend == "fp16-emulation" and c.precision not in MIXED for c in paper)
    assert {"gguf", "int8", "int4"} <= {c.precision for c in paper if c.backend == "onnxruntime"}
    quick = load_grid(preset="quick").configs()
    assert quick[0].backend == "torch"  # the baseline of each shape runs first


@pytest.mark.parametrize(("text", "message"), [
    ('models = ["m"]', "missing keys"),
    ('models=["m"]\nbackends=["cuda"]\nprecisions=["fp32"]\nbatch=[1]\nsequence=[8]\ninputs=["real"]', "'cuda'"),
    ('models=["m"]\nbackends=["torch"]\nprecisions=["fp32"]\nbatch=[0]\nsequence=[8]\ninputs=["real"]',
     "positive integers"),
    ('models=["m"]\ncolour="red"', "unknown keys"),
    ("models = [", "not valid TOML"),
])
def test_bad_grid_files_are_clear_errors(tmp_path, text, message):
    path = tmp_path / "grid.toml"
    path.write_text(text)
    with pytest.raises(TrtServeError, match=message):
        load_grid(path)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(TrtServeError, match="paper"):
        load_grid(preset="nope")


def test_the_gate_shapes_an_engine_took_from_a_confirm_grid_are_counted_by_its_recorded_label():
    from tests.manifests import FIDELITY, MODEL
    from trtserve.engine_dir.manifest import Manifest
    from trtserve.eval.runner import _grid_shapes as of_manifest

    def _grid_shapes(manifest):
        return of_manifest(Manifest.model_validate({**manifest, "model": MODEL,
                                                    "fidelity": {**FIDELITY, **manifest["fidelity"]}}))

    cases = {"random b8 seq128": {}, "random b1 seq64": {}, "random real b1 seq32": {}, "random random b4 seq32": {}}
    # a grid file named random.toml: its cases start with "random " as the gate's own random-id cases do
    manifest = {"build_command": "trtserve build-engine M --out E --confirm-grid /g/random.toml",
                "confirm_grid": {"grid": "/g/random.toml", "label": "random", "shapes": 2},
                "fidelity": {"onnxruntime": {"cases": cases}}}
    assert _grid_shapes(manifest) == 2  # not the gate's own random-id cases
    manifest["confirm_grid"]["label"] = "paper"
    assert _grid_shapes(manifest) == 0
    manifest["fidelity"]["onnxruntime"]["cases"] = {"paper real b1 seq32": {}, "random b8 seq128": {}}
    assert _grid_shapes(manifest) == 1
    del manifest["confirm_grid"]  # an engine built before the manifest recorded it
    manifest["build_command"] = "trtserve build-engine M --out E --confirm-grid paper"
    assert _grid_shapes(manifest) == 1


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "quick"
    result = run_cli("eval", "--preset", "quick", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def rows_of(out):
    from trtserve.eval.report import load_rows

    return load_rows(out)  # complete lines only


@pytest.mark.models
def test_quick_run_report_is_internally_consistent(quick_run):
    rows = rows_of(quick_run)
    assert len(rows) == len(load_grid(preset="quick").configs()) == len({r["key"] for r in rows})
    assert all(r["status"] == "ok" for r in rows)
    base = {(r["batch"], r["sequence"], r["input"]): r["latency_ms"]["p50"] for r in rows if r["backend"] == "torch"}
    summary = json.loads((quick_run / "summary.json").read_text())
    for name, speed in summary["speedup"].items():
        model, backend, precision = name.split("/")
        ratios = [base[(r["batch"], r["sequence"], r["input"])] / r["latency_ms"]["p50"] for r in rows
                  if (r["backend"], r["precision"]) == (backend, precision)]
        assert math.isclose(speed["best"], max(ratios)) and min(ratios) <= speed["median"] <= max(ratios)
    for r in rows:
        p = r["latency_ms"]
        assert r["runs"] >= 3 and p["p50"] <= p["p95"] <= p["p99"]
        assert math.isclose(r["tokens_per_s"], r["sequences_per_s"] * r["sequence"])
        if r["backend"] == "torch":
            assert r["fidelity"]["cosine"] == pytest.approx(1.0, abs=1e-12)
        elif r["precision"] == "fp32":
            assert r["fidelity"]["cosine"] > 0.99999 and r["fidelity"]["nonfinite"] == 0
        else:
            assert r["fidelity"]["worst_row_cosine"] > 0.999
        if r["backend"] != "torch":  # each row judged by its engine's own target: MiniLM meets it everywhere
            assert r["target_misses"] == [] and r["fidelity_positions"] == "every"
    built = json.loads((quick_run / "engines.json").read_text())
    assert set(built) == {"all-MiniLM-L6-v2/fp32", "all-MiniLM-L6-v2/hybrid"}
    runs = set(built["all-MiniLM-L6-v2/hybrid"]["runs"])  # and OpenVINO's, where its build chose it
    assert built["all-MiniLM-L6-v2/hybrid"]["passed"] and runs - {"openvino"} == {"onnxruntime", "fp16_emulation"}
    assert built["all-MiniLM-L6-v2/hybrid"]["sentences"]["onnxruntime"]["neighbours"] >= 0.95
    assert built["all-MiniLM-L6-v2/hybrid"]["resident_mb"] > 10  # its build's fresh-process figure (Linux)
    # each engine's gate held it to every shape the grid runs: MiniLM, batch 1 and 4, 32 and 64 tokens, 2 inputs
    assert built["all-MiniLM-L6-v2/hybrid"]["grid_shapes"] == built["all-MiniLM-L6-v2/fp32"]["grid_shapes"] == 8
    sizes = {(r["backend"], r["precision"]): r["engine_bytes"] for r in rows}
    assert sizes[("onnxruntime", "hybrid")] < 0.6 * sizes[("onnxruntime", "fp32")]
    down = json.loads((quick_run / "downstream.json").read_text())
    assert down["accuracy"]["torch/fp32"] > 0.6  # better than chance (0.5) on 60 held-out real sentences
    assert down["flips_vs_fp32"]["torch/fp32"] == 0 and down["flips_vs_fp32"]["onnxruntime/fp32"] == 0
    assert set(down["accuracy"]) == {"torch/fp32", "onnxruntime/fp32", "onnxruntime/hybrid", "fp16-emulation/hybrid"}
    report = (quick_run / "report.md").read_text()
    assert "## Speedup over torch fp32" in report and "fp16-emulation/hybrid" in report
    assert "| all-MiniLM-L6-v2/fp16-emulation/hybrid | 8 | 0 |" in report  # 8 shapes, none missing its target
    assert "## Build-time fidelity" in report and "| all-MiniLM-L6-v2/hybrid | fp16_emulation | yes |" in report
    assert "Every position of every row is judged." in report
    hybrid_gate = next(line for line in report.splitlines()
                       if line.startswith("| all-MiniLM-L6-v2/hybrid | onnxruntime |"))
    assert hybrid_gate.startswith("| all-MiniLM-L6-v2/hybrid | onnxruntime | yes | 8 |")
    assert hybrid_gate.endswith(f"| {built['all-MiniLM-L6-v2/hybrid']['resident_mb']:.0f} MB |")
    for plot in ("latency", "speedup", "fidelity", "memory"):
        assert (quick_run / f"{plot}-all-MiniLM-L6-v2.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.models
def test_resume_runs_only_what_is_missing_and_report_regenerates(quick_run, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    lines = (quick_run / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(lines[:-5]) + "\n" + lines[-5][:20])  # the last line cut short
    earlier = json.loads((quick_run / "engines.json").read_text())
    (out / "engines.json").write_text(json.dumps({f"earlier run/{k}": v for k, v in earlier.items()}))
    again = run_cli("eval", "--preset", "quick", "--out", str(out))
    assert again.returncode == 2 and "--resume" in again.stderr  # never overwrites results silently
    resumed = run_cli("eval", "--preset", "quick", "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "27 already measured, 5 to run" in resumed.stderr
    assert sorted({r["key"] for r in rows_of(out) if "status" in r}) == sorted(r["key"] for r in rows_of(quick_run))
    gates = json.loads((out / "engines.json").read_text())  # the earlier run's engines keep their gate lines
    assert {f"earlier run/{k}" for k in earlier} <= set(gates) and set(gates) - {f"earlier run/{k}" for k in earlier}
    (out / "report.md").unlink()
    assert run_cli("eval", "report", str(out)).returncode == 0 and (out / "report.md").is_file()


@pytest.mark.models
def test_a_policy_the_model_cannot_have_is_recorded_as_skipped_rows(quick_run, tmp_path):
    grid = tmp_path / "grid.toml"  # the quick grid's shape range: its fp32 engine is reused from the cache
    grid.write_text('models = ["all-MiniLM-L6-v2"]\nbackends = ["torch", "onnxruntime"]\n'
                    'precisions = ["fp32", "gguf"]\n'
                    'batch = [1, 4]\nsequence = [32]\ninputs = ["real"]\nmin_runs = 1\nmin_seconds = 0\n')
    result = run_cli("eval", "--grid", str(grid), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r["precision"], r["backend"], r["batch"]): r for r in rows_of(tmp_path / "out")}
    assert len(rows) == 6
    for batch in (1, 4):
        assert rows["fp32", "torch", batch]["status"] == "ok" and rows["fp32", "onnxruntime", batch]["status"] == "ok"
        skipped = rows["gguf", "onnxruntime", batch]
        assert skipped["status"] == "skipped" and "no gguf engine of all-MiniLM-L6-v2" in skipped["why"]
        assert "GGUF" in skipped["why"]  # the build's own reason
    assert (tmp_path / "out" / "report.md").is_file()


@pytest.mark.models
def test_ctrl_c_keeps_every_measured_line(quick_run, tmp_path):
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "trtserve", "eval", "--preset", "quick", "--out", str(out)],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "results.jsonl").is_file() or len((out / "results.jsonl").read_text().splitlines()) < 4:
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be interrupted"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) >= 4 and all(json.loads(line)["status"] == "ok" for line in lines)  # none half written
    assert "rerun with --resume" in err
    resumed = run_cli("eval", "--preset", "quick", "--out", str(out), "--resume")
    assert resumed.returncode == 0 and len(rows_of(out)) == len(load_grid(preset="quick").configs())

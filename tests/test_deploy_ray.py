"""`trtserve serve --ray` on a real local Ray cluster (started here with `ray start --head`), through the
official `openai` client: one deployment of two replicas, each holding MiniLM and SmolLM2; embeddings
and chat over both replicas, and a replica killed under load."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import ROOT, require_package
from trtserve.testing.server import free_port

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    require_package("ray", "pip install 'trtserve[ray]'")
    ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    port = free_port()
    # 4 logical CPUs on this 2-core machine: two 1-CPU replicas plus room for Ray's own actors.
    started = subprocess.run([ray, "start", "--head", "--port", str(port), "--num-cpus", "4", "--num-gpus", "0",
                              "--include-dashboard", "false", "--disable-usage-stats"],
                             capture_output=True, text=True, timeout=180,
                             env=dict(os.environ, RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S="30"))  # 2 busy cores
    assert started.returncode == 0, started.stdout + started.stderr
    yield f"127.0.0.1:{port}"
    subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120)


class RayServer:
    def __init__(self, engines: list[Path], address: str, tmp: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"ray-serve-{self.port}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "trtserve", "serve", *map(str, engines), "--ray",
                                          "--ray-address", address, "--replicas", "2", "--port", str(self.port)],
                                         cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.wait(lambda pids: len(pids) == 2, 300)

    def pids(self, probes: int = 12) -> set[int]:
        found = set()
        for _ in range(probes):
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
            except httpx.HTTPError:
                continue
            if response.status_code == 200:  # a replica runs its engines in its own process: one pid for all
                pids = {m["workers"][0]["pid"] for m in response.json()["models"].values()}
                assert len(pids) == 1, response.json()
                found |= pids
        return found

    def wait(self, condition, seconds: float) -> set[int]:
        deadline = time.time() + seconds
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            pids = self.pids()
            if condition(pids):
                return pids
            time.sleep(1)
        raise AssertionError(f"condition not met in {seconds} s; log: {self.log.read_text()[-3000:]}")

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            assert self.proc.wait(timeout=120) == 0, self.log.read_text()[-3000:]
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_embeddings_and_chat_over_two_replicas_and_a_killed_replica_recovers(engines, ray_cluster, tmp_path):
    from trtserve.runtime import load_backend
    from trtserve.runtime.text import TextEngine

    texts = ["Ray spreads requests over replicas.", "Each replica owns one backend.", "Paris is in France."]
    expected = TextEngine(load_backend(engines["minilm"], "onnxruntime")).embed(texts)
    server = RayServer([engines["minilm"], engines["smollm2"]], ray_cluster, tmp_path)
    try:
        api = client(server.url)
        assert [m.id for m in api.models.list().data] == ["all-MiniLM-L6-v2", "SmolLM2-135M-Instruct"]
        for _ in range(6):  # requests land on both replicas; every answer matches the engine run here
            got = np.array([d.embedding for d in api.embeddings.create(model="all-MiniLM-L6-v2", input=texts).data])
            assert np.abs(got - expected).max() < 1e-5
        question = [{"role": "user", "content": "What is the capital of France?"}]
        for _ in range(4):
            stream = api.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=16,
                                                 temperature=0, stream=True)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            assert "Paris" in text, text
        whole = api.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=16,
                                            temperature=0)
        assert whole.choices[0].message.content == text and whole.usage.completion_tokens > 0

        before = server.pids()
        victim = sorted(before)[0]
        statuses, stop = [], threading.Event()

        def load():
            while not stop.is_set():
                try:
                    statuses.append(httpx.post(f"{server.url}/v1/embeddings", json={"model": "all-MiniLM-L6-v2",
                                                                                   "input": texts},
                                               timeout=60).status_code)
                except httpx.HTTPError as exc:
                    statuses.append(type(exc).__name__)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(2)
        os.kill(victim, signal.SIGKILL)
        after = server.wait(lambda pids: len(pids) == 2 and victim not in pids, 180)
        time.sleep(2)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert len(after - before) == 1  # one new replica; the other one untouched
        failed = [s for s in statuses if s != 200]
        assert statuses.count(200) > 20, statuses
        assert all(s in (500, 502, 503) for s in failed), failed  # an error answer, never a hang
        assert len(failed) <= 4, failed  # at most the requests in flight on the killed replica
        answers = [httpx.post(f"{server.url}/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": texts},
                              timeout=60).status_code for _ in range(10)]
        assert answers == [200] * 10
    finally:
        server.stop()

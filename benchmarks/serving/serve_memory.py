"""Resident memory of one server holding several engines: the server process and each engine's
workers, VmRSS from /proc after one request per engine.

    .venv/bin/python -m benchmarks.serving.serve_memory engines/minilm engines/smollm2 int4=engines/smollm2-int4
"""

from __future__ import annotations

import sys

import httpx

from benchmarks.common import ROOT, rss_mb
from trtserve.testing.server import free_port


def main() -> None:
    import subprocess
    import time

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trtserve", "serve", *sys.argv[1:], "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    try:
        health = httpx.get(f"{url}/health").json()["models"]
        for name, entry in health.items():
            if entry["kind"] == "encoder":
                httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": "hello there"}, timeout=120)
            else:
                httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "The capital of France is",
                                                          "max_tokens": 16}, timeout=120)
        print(f"server process: {rss_mb(proc.pid):.0f} MB")
        for name, entry in httpx.get(f"{url}/health").json()["models"].items():
            for worker in entry["workers"]:
                print(f"{name} ({entry['kind']}) worker {worker['index']}: {rss_mb(worker['pid']):.0f} MB")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()

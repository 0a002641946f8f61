"""The real server as a subprocess on a free port, for the server tests."""

import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.conftest import ROOT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(engine, *flags, env: dict | None = None):
    """`env`: the server's whole environment (its worker processes inherit it); None: this one's."""
    port = free_port()
    # The log goes to a file: an unread pipe fills up after a few hundred access-log lines and
    # then blocks the server.
    log = tempfile.NamedTemporaryFile("w+", prefix="trtserve-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "trtserve", "serve", str(engine), "--port", str(port), *flags],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    proc.log_path = Path(log.name)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, Path(log.name).read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not become healthy in 120 s")


def stop_server(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log_path.unlink(missing_ok=True)


def metric(url: str, name: str) -> float:
    """The value of one sample on the server's /metrics page, summed over its label sets (one per engine)."""
    values = [float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
              if line.startswith((name + " ", name + "{"))]
    assert values, f"{name} is not on /metrics"
    return sum(values)

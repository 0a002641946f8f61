"""The real server as a subprocess on a free port: what the server tests and the serving benchmarks start and stop
(run from the repository's root, as both are)."""

import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(engine, *flags, env: dict | None = None, verify=None, wait: float = 120):
    """`env`: the server's whole environment (its worker processes inherit it); None: this one's. `verify`: the
    CA file of a server that serves HTTPS (--ssl-certfile). `wait`: seconds it has to answer /health."""
    port = free_port()
    return launch([sys.executable, "-m", "trtserve", "serve", str(engine), "--port", str(port), *flags], port,
                  env=env, name="trtserve-server", verify=verify, wait=wait)


def launch(argv: list, port: int, env: dict | None = None, name: str = "server", verify=None, wait: float = 120):
    """Start a server that listens on `port` (its output to a log file, `proc.log_path`); (process, url) once
    its /health answers 200, within `wait` seconds. `verify`: HTTPS, checked against this CA file."""
    # The log goes to a file: an unread pipe fills up after a few hundred access-log lines and
    # then blocks the server.
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]  # for the caller, on the process it gets
    url = f"{'https' if verify else 'http'}://127.0.0.1:{port}"
    checked = ssl.create_default_context(cafile=str(verify)) if verify else True
    deadline = time.time() + wait
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited: " + proc.log_path.read_text()[-3000:])  # type: ignore[attr-defined]
        try:
            if httpx.get(f"{url}/health", timeout=1, verify=checked).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"{name} did not become healthy in {wait:g} s")


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

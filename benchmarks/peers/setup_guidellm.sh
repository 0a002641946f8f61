#!/usr/bin/env bash
# guidellm, the load generator of benchmarks/serving/bench_serving.py, in a venv of its own at
# $TRTSERVE_CACHE/peers/guidellm-venv (default ~/.cache/trtserve): never a dependency of trtserve. torch is
# installed first, pinned to the CPU build (guidellm pulls transformers, and an unpinned torch is a
# multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=$(.venv/bin/python -c "from trtserve.fileio import cache_root; print(cache_root() / 'peers' / 'guidellm-venv')")
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "guidellm==0.7.3"
echo "$venv/bin/guidellm"

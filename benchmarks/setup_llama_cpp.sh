#!/usr/bin/env bash
# The llama.cpp peer for benchmarks/bench_decode.py --llama-cpp: llama-cpp-python built from source
# into the project's venv (a benchmark-only package, never a dependency of trtserve). A few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    .venv/bin/pip install --no-deps --no-binary llama-cpp-python "llama-cpp-python==0.3.36" diskcache jinja2

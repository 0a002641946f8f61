#!/usr/bin/env bash
# The llama.cpp peer for benchmarks/decode/bench_decode.py --llama-cpp: llama-cpp-python built from source
# into the project's venv (a benchmark-only package, never a dependency of trtserve). 10 to 17 minutes
# on 2 cores, for the host's vector extensions (benchmarks/peers/llama_cpp_flags.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_flags.sh
CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS" \
CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install --force-reinstall --no-cache-dir --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==0.3.36" diskcache jinja2

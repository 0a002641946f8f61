#!/usr/bin/env bash
# The llama.cpp peer for benchmarks/bench_decode.py --llama-cpp: llama-cpp-python built from source
# into the project's venv (a benchmark-only package, never a dependency of trtserve). About 10 minutes
# on 2 cores. AVX-512 (VNNI, BF16) on, AMX off: its tile instructions fault on VMs that advertise them
# without enabling them.
set -euo pipefail
cd "$(dirname "$0")/.."
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF" \
CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install --force-reinstall --no-cache-dir --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==0.3.36" diskcache jinja2

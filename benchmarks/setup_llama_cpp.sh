#!/usr/bin/env bash
# The llama.cpp peer for benchmarks/bench_decode.py --llama-cpp: llama-cpp-python built from source
# into the project's venv (a benchmark-only package, never a dependency of trtserve). 10 to 17 minutes
# on 2 cores. The host's AVX/AVX2/AVX-512 extensions on (from /proc/cpuinfo), AMX off: its tile
# instructions fault on VMs that advertise them without enabling them.
set -euo pipefail
cd "$(dirname "$0")/.."
has() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1" && echo ON || echo OFF; }
# the host's own vector extensions (a build for AVX-512 dies of an illegal instruction on an AVX2-only CPU)
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) \
-DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VNNI=$(has avx512_vnni) \
-DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF" \
CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install --force-reinstall --no-cache-dir --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==0.3.36" diskcache jinja2

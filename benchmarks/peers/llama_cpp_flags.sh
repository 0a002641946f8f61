#!/usr/bin/env bash
# CMake flags for a llama.cpp build on this host, sourced by the llama.cpp peer setups: the host's own
# AVX/AVX2/AVX-512 extensions from /proc/cpuinfo (a build for AVX-512 dies of an illegal instruction on an
# AVX2-only CPU), AMX off (its tile instructions fault on VMs that advertise them without enabling them),
# no downloads at build time.
has() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1" && echo ON || echo OFF; }
LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) \
-DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VNNI=$(has avx512_vnni) \
-DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"

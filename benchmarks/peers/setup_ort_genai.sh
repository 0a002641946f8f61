#!/usr/bin/env bash
# The ONNX Runtime GenAI peer for benchmarks/decode/bench_decode.py --ort-genai: onnxruntime-genai 0.18 into the
# project's venv without its dependencies (it runs on the venv's onnxruntime 1.32, the runtime trtserve uses;
# a benchmark-only package, never a dependency of trtserve), then its model builder on the bundled SmolLM2's
# converted fp32 checkpoint, fp32 and int4 (MatMulNBits, blocks of 32, accuracy level 4: its CPU default),
# into $TRTSERVE_CACHE/peers/ (default ~/.cache/trtserve). A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/pip install --no-deps "onnxruntime-genai==0.18.0"
checkpoint=$(.venv/bin/python -c "from trtserve.models.sources import resolve; print(resolve('SmolLM2-135M-Instruct').path)")
out=$(.venv/bin/python -c "from trtserve.fileio import cache_root; print(cache_root() / 'peers')")
for precision in fp32 int4; do
    dir="$out/ort-genai-smollm2-$precision"
    [ -f "$dir/genai_config.json" ] && continue
    .venv/bin/python -m onnxruntime_genai.models.builder -i "$checkpoint" -o "$dir" -p "$precision" -e cpu \
        -c "$out/ort-genai-cache"
done
rm -rf "$out/ort-genai-cache"
echo "ONNX Runtime GenAI models: $out/ort-genai-smollm2-fp32 $out/ort-genai-smollm2-int4"

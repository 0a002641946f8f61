#!/usr/bin/env bash
# The main job on the CPU default: build engines for the two bundled real models and run them on
# real text, printing the results and their parity against torch fp32; then serve SmolLM2 and
# ask it a question through the official openai client.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-engines}
.venv/bin/build-engine SmolLM2-135M-Instruct --out "$OUT/smollm2"
.venv/bin/trtserve run "$OUT/smollm2" --text "The capital of France is" --max-new-tokens 8
.venv/bin/trtserve run "$OUT/smollm2"
.venv/bin/python scripts/demo_serve.py "$OUT/smollm2"   # the OpenAI-compatible server, streamed chat
.venv/bin/build-engine all-MiniLM-L6-v2 --out "$OUT/minilm"
.venv/bin/trtserve run "$OUT/minilm" --text "A man is playing a guitar." \
  --text "Someone is playing an instrument." --text "The stock market fell sharply today."

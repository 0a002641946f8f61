"""Per-length fidelity table of engine dirs, from the measurements stored in their manifests.

    .venv/bin/python -m benchmarks.precision.fidelity_table engines/minilm-hybrid engines/smollm2-hybrid ...

Every figure was measured by `build-engine` (or `trtserve fidelity`) against torch fp32 on real
text; this script only formats them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(engine: Path):
    m = json.loads((engine / "manifest.json").read_text())
    fidelity, policy = m["fidelity"], m["precision"]["policy"]
    for run in ("onnxruntime", "fp16_emulation"):
        if run not in fidelity:
            continue
        for label, case in fidelity[run]["cases"].items():
            main = case.get("logits") or case["hidden"]
            yield (m["model"]["id"], policy, run, label.removeprefix("seq"), main["cosine"], main["worst_row_cosine"],
                   main["nonfinite"], case.get("top1_agreement"), case.get("perplexity_rel_delta"))


def main() -> None:
    print("| model | policy | run | shape (tokens) | cosine | worst-token cosine | NaN/Inf | top-1 | ppl delta |")
    print("|---|---|---|---|---|---|---|---|---|")
    for engine in map(Path, sys.argv[1:]):
        for model, policy, run, length, cos, worst, bad, top1, ppl in rows(engine):
            top1_text = "" if top1 is None else f"{top1:.2%}"
            ppl_text = "" if ppl is None else f"{ppl:.2e}"
            print(f"| {model} | {policy} | {run} | {length} | {cos:.6f} | {worst:.6f} | {bad} | "
                  f"{top1_text} | {ppl_text} |")


if __name__ == "__main__":
    main()

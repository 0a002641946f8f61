"""TensorRT plans for existing engine directories, built twice each: plan size, build time, layer
output types of the parsed network, kernels after fusion, and how many bytes two builds differ by.
Needs TensorRT or TensorRT-RTX (RTX builds without a GPU).

    .venv/bin/python -m benchmarks.probes.trt_plans ENGINE_DIR [ENGINE_DIR ...]
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    from trtserve.engine_builder.tensorrt import build_trt

    for src in map(Path, sys.argv[1:]):
        manifest = json.loads((src / "manifest.json").read_text())
        with tempfile.TemporaryDirectory() as scratch:
            plans, seconds = [], []
            for i in range(2):
                out = Path(scratch) / str(i)
                out.mkdir()
                started = time.time()
                entry = build_trt(src / "model.onnx", out, manifest)
                seconds.append(time.time() - started)
                plans.append(np.frombuffer((out / "model.plan").read_bytes(), np.uint8))
            same_size = len(plans[0]) == len(plans[1])
            differ = int(np.count_nonzero(plans[0] != plans[1])) if same_size else "sizes differ"
        layers = entry["layer_precision"]["float_outputs_by_layer_type"]
        wanted = {k: layers[k] for k in ("MATRIX_MULTIPLY", "SOFTMAX", "NORMALIZATION", "REDUCE") if k in layers}
        print(f"{manifest['model']['id']} {manifest['precision']['policy']}: plan {len(plans[0]) / 1e6:.1f} MB, "
              f"build {min(seconds):.1f} s, layers {wanted}, violations {len(entry['layer_precision']['violations'])}, "
              f"kernels {entry['kernels']['count']} {entry['kernels']['output_dtypes_by_kernel_type']}, "
              f"two builds differ in {differ} bytes")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()

"""OpenVINO on a decoder's graph: one decode step (batch 1, or `--batch` rows) of an engine's portable graph
(`model.onnx`, the cache passed in and out) in OpenVINO (f32 or bf16, with or without its dynamic quantization
of activations), against ONNX Runtime's optimized graph of the same engine (`model.ort.onnx`, the same inputs),
taking turns, medians; and how far OpenVINO's logits are from ONNX Runtime's (the relative max difference and
top-1 agreement over the past positions' next tokens). What a decoder on OpenVINO would gain: the backend
(runtime/openvino.py) serves encoders only.

    .venv/bin/python -m benchmarks.probes.probe_openvino --engine DIR [--engine DIR ...] [--past 128] [--batch 1]
        [--rounds 5]   (openvino: pip install 'trtserve[openvino]')
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

# OpenVINO's CPU defaults round activations of compressed-weight GEMMs to int8 in groups (dynamic quantization)
# and compute in bf16 where the CPU has it: each variant says what it changes.
VARIANTS = {
    "f32, no dynamic quantization": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
    "f32, dynamic quantization in groups of 32": {"INFERENCE_PRECISION_HINT": "f32",
                                                  "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32},
    "bf16, no dynamic quantization": {"INFERENCE_PRECISION_HINT": "bf16", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
}


def feeds(names: list[str], ids: np.ndarray, past: int, kv_shape: tuple[int, int]) -> dict:
    heads, dim = kv_shape
    rows, length = ids.shape
    out = {"input_ids": ids, "attention_mask": np.ones((rows, past + length), np.int64),
           "position_ids": np.repeat(np.arange(past, past + length, dtype=np.int64)[None], rows, 0),
           "logit_positions": np.array([length - 1], np.int64)}
    rng = np.random.default_rng(1)
    for name in names:
        if name.startswith("past_key_values."):
            out[name] = rng.standard_normal((rows, heads, past, dim)).astype(np.float32) * 0.5
    return {k: v for k, v in out.items() if k in names}


def main() -> None:
    import onnxruntime as ort
    import openvino as ov

    from trtserve.engine_dir import open_engine_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", required=True)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="rows decoded in one step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    core = ov.Core()
    print(f"OpenVINO {ov.__version__}, ONNX Runtime {ort.__version__}; batch {args.batch}, past {args.past}, "
          f"{args.threads} threads, median of {args.rounds} rounds x {args.steps} steps; "
          f"CPU {core.get_property('CPU', 'FULL_DEVICE_NAME')}")
    print("| engine | runtime | ms/step | vs ONNX Runtime | logits: max difference / largest "
          "| next-token top-1 vs ONNX Runtime |")
    print("|---|---|---:|---:|---:|---:|")
    for path in args.engine:
        engine = open_engine_dir(path)
        arch = engine.manifest.model.architecture
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.log_severity_level = args.threads, 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(engine.file("model.ort.onnx")), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        step = feeds(names, np.arange(1234, 1234 + args.batch, dtype=np.int64)[:, None], args.past,
                     (arch.num_kv_heads, arch.head_dim))
        prompt = feeds(names, np.random.default_rng(2).integers(1000, 40000, (1, 64)), 0,
                       (arch.num_kv_heads, arch.head_dim))
        prompt["logit_positions"] = np.arange(64, dtype=np.int64)
        runs = {"onnxruntime": lambda f, s=session: s.run(["logits"], f)[0]}
        model = core.read_model(str(engine.file(engine.manifest.onnx.file)))
        for label, config in VARIANTS.items():
            compiled = core.compile_model(model, "CPU", {**config, "INFERENCE_NUM_THREADS": args.threads,
                                                         "PERFORMANCE_HINT": "LATENCY"})
            request = compiled.create_infer_request()
            runs[f"openvino {label}"] = lambda f, r=request: r.infer(f)["logits"].copy()
        times = {name: [] for name in runs}
        for round_ in range(args.rounds):
            order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
            for name in order:
                runs[name](step)
                started = time.perf_counter()
                for _ in range(args.steps):
                    runs[name](step)
                times[name].append((time.perf_counter() - started) / args.steps * 1e3)
        reference = runs["onnxruntime"](prompt)
        for name in runs:
            logits = runs[name](prompt)
            ms = statistics.median(times[name])
            base = statistics.median(times["onnxruntime"])
            diff = float(np.abs(logits - reference).max() / np.abs(reference).max())
            top1 = float((logits.argmax(-1) == reference.argmax(-1)).mean())
            print(f"| {Path(path).name} ({engine.manifest.precision.policy}) | {name} | {ms:.2f} | {base / ms:.2f}x | "
                  f"{diff:.1e} | {top1:.1%} |", flush=True)


if __name__ == "__main__":
    main()

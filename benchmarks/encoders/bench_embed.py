"""Encoder engines side by side (each on ONNX Runtime, and on OpenVINO where its build kept an OpenVINO
precision), and the peers a user would reach for on the CPU: ONNX Runtime's `quantize_dynamic` (int8, per
channel, MatMul only) of the first engine's own portable graph and, with `--sentence-transformers`,
sentence-transformers itself on the first engine's checkpoint (torch, its default attention, mean pooling and
normalization as all-MiniLM-L6-v2 declares; install it into the venv with `pip install sentence-transformers
scikit-learn`: a benchmark-only package). Same real-text token ids for everyone, sequence 128, batch 32 and
batch 1, 2 threads, engines taking turns (order reversed every other round; each timed call after an untimed one
of its own), medians; and each one's sentence-embedding cosine to the first engine's on the 200 labelled Pang &
Lee sentences (padded batches of 32).

    .venv/bin/python -m benchmarks.encoders.bench_embed --engine fp32=engines/minilm --engine int8=DIR [--rounds 7]
        [--sentence-transformers]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def session(graph: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])


def feeds(engine: Path, batch: int, length: int) -> dict:
    from trtserve.models.loading import load_hf_tokenizer
    from trtserve.precision.measure import Corpus

    ids = np.array(Corpus.wikipedia().rows(load_hf_tokenizer(engine), batch, length), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


class OrtRunner:
    def __init__(self, graph: Path, threads: int):
        self.session = session(graph, threads)
        self.inputs = {i.name for i in self.session.get_inputs()}

    def __call__(self, feed: dict) -> np.ndarray:
        return self.session.run(["sentence_embedding"], {k: v for k, v in feed.items() if k in self.inputs})[0]


class OpenVinoRunner:
    """An engine's OpenVINO part, in the precision its build kept (runtime.openvino)."""

    def __init__(self, engine: Path, threads: int):
        from trtserve.runtime import load_backend

        self.backend = load_backend(engine, "openvino", threads=threads)
        self.inputs = {spec.name for spec in self.backend.inputs}

    def __call__(self, feed: dict) -> np.ndarray:
        return self.backend.infer({k: v for k, v in feed.items() if k in self.inputs})["sentence_embedding"]


class SentenceTransformersRunner:
    """sentence-transformers' model on the engine's checkpoint, called on token ids as its `encode` calls it
    after tokenizing (the forward, pooling and normalization under inference mode)."""

    def __init__(self, engine: Path, threads: int):
        import torch
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer import modules as models

        from trtserve.engine_dir import open_engine_dir
        from trtserve.models.sources import resolve

        torch.set_num_threads(threads)
        checkpoint = resolve(open_engine_dir(engine).manifest.model.source).path
        encoder = models.Transformer(str(checkpoint), max_seq_length=512)
        self.model = SentenceTransformer(modules=[encoder, models.Pooling(encoder.get_embedding_dimension(), "mean"),
                                                  models.Normalize()], device="cpu")
        self.torch = torch

    def __call__(self, feed: dict) -> np.ndarray:
        with self.torch.inference_mode():
            out = self.model({k: self.torch.from_numpy(v) for k, v in feed.items()})
        return out["sentence_embedding"].numpy()


def sentence_cosines(runners: dict, engine: Path) -> dict:
    """(mean, worst) cosine of each runner's sentence embeddings to the first runner's."""
    from trtserve.data.sentiment import polarity
    from trtserve.models.loading import load_hf_tokenizer

    texts, _ = polarity()
    tokenizer = load_hf_tokenizer(engine)
    out = {}
    for name, run in runners.items():
        rows = []
        for i in range(0, len(texts), 32):
            enc = tokenizer(texts[i:i + 32], padding=True, truncation=True, max_length=128, return_tensors="np")
            rows.append(run({k: v.astype(np.int64) for k, v in enc.items()}))
        out[name] = np.concatenate(rows).astype(np.float64)
    base = next(iter(out.values()))
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    return {name: ((unit(x) * unit(base)).sum(1).mean(), (unit(x) * unit(base)).sum(1).min())
            for name, x in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", required=True, help="NAME=DIR (the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sentence-transformers", action="store_true",
                        help="also time sentence-transformers on the first engine's checkpoint")
    args = parser.parse_args()
    from onnxruntime.quantization import QuantType, quantize_dynamic

    engines = dict(item.split("=", 1) for item in args.engine)
    first = Path(next(iter(engines.values())))
    graphs = {name: Path(d) / "model.ort.onnx" for name, d in engines.items()}
    scratch = Path(tempfile.mkdtemp(prefix="trtserve-bench-"))
    peer = "ORT quantize_dynamic int8 (peer)"
    graphs[peer] = scratch / "dynamic.onnx"
    quantize_dynamic(str(first / "model.onnx"), str(graphs[peer]), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"])
    sessions = {name: OrtRunner(g, args.threads) for name, g in graphs.items()}
    from trtserve.engine_dir import open_engine_dir

    for name, d in engines.items():  # each engine's OpenVINO part, where its build kept one
        entry = open_engine_dir(d).manifest.openvino
        if entry and entry.inference_precision:
            sessions[f"{name}, OpenVINO {entry.inference_precision}"] = OpenVinoRunner(Path(d), args.threads)
    if args.sentence_transformers:
        sessions["sentence-transformers (peer)"] = SentenceTransformersRunner(first, args.threads)
    shapes = {"batch 32 x 128": feeds(first, 32, 128), "batch 1 x 128": feeds(first, 1, 128)}
    times = {(name, shape): [] for name in sessions for shape in shapes}
    for run in sessions.values():
        for f in shapes.values():
            run(f)
    for r in range(args.rounds):
        order = list(sessions) if r % 2 == 0 else list(sessions)[::-1]
        for name in order:
            for shape, f in shapes.items():
                sessions[name](f)  # untimed: the runner before may still hold the cores (ONNX Runtime's spinning)
                started = time.perf_counter()
                sessions[name](f)
                times[name, shape].append(time.perf_counter() - started)
    med = {k: statistics.median(v) for k, v in times.items()}
    cosines = sentence_cosines(sessions, first)
    base = next(iter(engines))
    print(f"sequence 128 (real text), {args.threads} threads, median of {args.rounds} interleaved rounds")
    print("| engine | batch 32 x 128 | vs first | batch 1 x 128 | vs first | sentence cosine mean / worst |")
    print("|---|---|---|---|---|---|")
    for name in sessions:
        big, one = med[name, "batch 32 x 128"], med[name, "batch 1 x 128"]
        print(f"| {name} | {32 / big:.1f} seq/s | {med[base, 'batch 32 x 128'] / big:.2f}x | {one * 1e3:.2f} ms "
              f"| {med[base, 'batch 1 x 128'] / one:.2f}x | {cosines[name][0]:.5f} / {cosines[name][1]:.5f} |")


if __name__ == "__main__":
    main()

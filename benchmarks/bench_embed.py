"""Encoder engines side by side, and the peer a user would reach for on the CPU: ONNX Runtime's
`quantize_dynamic` (int8, per channel, MatMul only) of the first engine's own portable graph. Same
real-text token ids for everyone, sequence 128, batch 32 and batch 1, 2 threads, engines taking turns
(order reversed every other round), medians; and each one's sentence-embedding cosine to the first
engine's on the 200 labelled Pang & Lee sentences (padded batches of 32).

    .venv/bin/python benchmarks/bench_embed.py --engine fp32=engines/minilm --engine int8=DIR [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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


def sentence_cosines(sessions: dict, engine: Path) -> dict:
    """(mean, worst) cosine of each session's sentence embeddings to the first session's."""
    from trtserve.data.sentiment import polarity
    from trtserve.models.loading import load_hf_tokenizer

    texts, _ = polarity()
    tokenizer = load_hf_tokenizer(engine)
    out = {}
    for name, s in sessions.items():
        names = {i.name for i in s.get_inputs()}
        rows = []
        for i in range(0, len(texts), 32):
            enc = tokenizer(texts[i:i + 32], padding=True, truncation=True, max_length=128, return_tensors="np")
            rows.append(s.run(["sentence_embedding"], {k: enc[k].astype(np.int64) for k in names})[0])
        out[name] = np.concatenate(rows).astype(np.float64)
    base = next(iter(out.values()))
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    return {name: ((unit(x) * unit(base)).sum(1).mean(), (unit(x) * unit(base)).sum(1).min()) for name, x in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", required=True, help="NAME=DIR (the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
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
    sessions = {name: session(g, args.threads) for name, g in graphs.items()}
    shapes = {"batch 32 x 128": feeds(first, 32, 128), "batch 1 x 128": feeds(first, 1, 128)}
    names = {spec.name for spec in next(iter(sessions.values())).get_inputs()}
    shapes = {k: {n: v for n, v in f.items() if n in names} for k, f in shapes.items()}
    times = {(name, shape): [] for name in sessions for shape in shapes}
    for s in sessions.values():
        for f in shapes.values():
            s.run(None, f)
    for r in range(args.rounds):
        order = list(sessions) if r % 2 == 0 else list(sessions)[::-1]
        for name in order:
            for shape, f in shapes.items():
                started = time.perf_counter()
                sessions[name].run(None, f)
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

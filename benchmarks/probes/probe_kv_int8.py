"""What an 8-bit KV cache would cost in fidelity: ONNX Runtime 1.32's CPU GroupQueryAttention takes an int8
cache with static scales (PER_TENSOR or PER_CHANNEL, `k_scale`/`v_scale` inputs), a quarter of the fp32
cache's bytes. This probe gives a copy of an engine's decode graph an int8 cache with one scale per head and
channel (the largest magnitude seen on calibration windows / 127), then compares it with the fp32 decode
graph on other windows: next-token top-1 agreement, perplexity change and mean KL divergence, every position.
Calibration: real text (the bundled Wikipedia sample, windows before the evaluated ones) and random ids.
Nothing of this is in the engine; the probe writes its graph to a temporary directory.

    .venv/bin/python -m benchmarks.probes.probe_kv_int8 --engine engines/smollm2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

CHUNK = 256


def session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feed(slots, ids: np.ndarray, chunk: int, logits: bool = True) -> np.ndarray | None:
    """A fresh sequence in slot 0, fed `chunk` tokens per call; every position's logits when asked."""
    slots.clear(0)
    out = []
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk][None]
        n = part.shape[1]
        index = np.arange(n)[None] if logits else np.array([[n - 1]])
        out.append(slots.run(0, part, np.array([n]), index)[0])
    return np.concatenate(out) if logits else None


def int8_graph(src: Path, dst: Path, largest: dict) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        layer = node.input[3].split(".")[1]  # past_key_values.{i}.key
        inputs = list(node.input) + [""] * (15 - len(node.input))
        for kind, position in (("key", 12), ("value", 13)):
            scale = np.maximum(largest[f"past_key_values.{layer}.{kind}"], 1e-6) / 127
            name = f"probe.{layer}.{kind}_scale"
            graph.initializer.append(numpy_helper.from_array(scale.astype(np.float32)[None, :, None, :], name))
            inputs[position] = name
        del node.input[:]
        node.input.extend(inputs)
        kept = [a for a in node.attribute if a.name not in ("k_quant_type", "v_quant_type", "kv_cache_bit_width")]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                                      helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                                      helper.make_attribute("kv_cache_bit_width", 8)])
    for value in list(graph.input) + list(graph.output):
        if value.name.startswith(("past_key_values.", "present.")):
            value.type.tensor_type.elem_type = TensorProto.INT8
    onnx.save(model, str(dst))


def compare(a: np.ndarray, b: np.ndarray, ids: np.ndarray) -> tuple[float, float, float]:
    """(top-1 agreement, perplexity change of b against a on the next tokens, mean KL(a || b))."""
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    la, lb = log_softmax(a[:-1].astype(np.float64)), log_softmax(b[:-1].astype(np.float64))
    rows, target = np.arange(len(ids) - 1), ids[1:]
    ppl = np.exp(la[rows, target].mean() - lb[rows, target].mean()) - 1
    kl = (np.exp(la) * (la - lb)).sum(-1).mean()
    return float((a.argmax(-1) == b.argmax(-1)).mean()), float(ppl), float(kl)


def main() -> None:
    from tokenizers import Tokenizer

    from trtserve.data.corpus import wiki_text
    from trtserve.engine_dir import open_engine_dir
    from trtserve.runtime.kv_slots import KV_GRAPH, KVSlots

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = open_engine_dir(args.engine)
    if not engine.file(KV_GRAPH).is_file():
        sys.exit(f"{args.engine} has no decode graph")
    ids = np.array(Tokenizer.from_file(str(engine.file("tokenizer.json"))).encode(wiki_text(6000)).ids, np.int64)
    vocab = engine.manifest.model.architecture.vocab_size
    rng = np.random.default_rng(0)
    reference = KVSlots(engine, 1, session=session(engine.file(KV_GRAPH), args.threads))
    largest: dict[str, np.ndarray] = {}
    for window in (ids[:1024], ids[1024:2048], rng.integers(0, vocab, 512)):
        feed(reference, window, CHUNK, logits=False)
        n = int(reference.length[0])
        for name, buffer in reference.buffers.items():
            largest[name] = np.maximum(largest.get(name, 0), np.abs(buffer[0, :, :n]).max(1))
    shapes = [("real text, 2,048 tokens in chunks of 256", ids[3000:5048], CHUNK),
              ("real text, 512 tokens one at a time", ids[6000:6512], 1),
              ("real text, 128 tokens in one call", ids[7000:7128], 128),
              ("random ids, 1,024 tokens in chunks of 128", rng.integers(0, vocab, 1024), 128)]
    with tempfile.TemporaryDirectory() as tmp:
        int8_graph(engine.file(KV_GRAPH), Path(tmp) / KV_GRAPH, largest)
        quantized = KVSlots(engine, 1, session=session(Path(tmp) / KV_GRAPH, args.threads))  # int8 buffers
        print(f"engine {args.engine}: int8 KV cache, one static scale per head and channel, against the fp32 cache")
        print("| window | top-1 agreement | perplexity change | mean KL |")
        print("|---|---:|---:|---:|")
        for label, window, chunk in shapes:
            top1, ppl, kl = compare(feed(reference, window, chunk), feed(quantized, window, chunk), window)
            print(f"| {label} | {top1:.2%} | {ppl:+.2%} | {kl:.2e} |")


if __name__ == "__main__":
    main()

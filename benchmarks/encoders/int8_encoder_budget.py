"""Where an encoder's int8 error comes from, measured against the encoder int8 target.

ONNX Runtime's fast int8 GEMMs on the CPU (`quantize_dynamic`'s MatMulInteger / DynamicQuantizeMatMul) take
weights with one scale per output channel and activations rounded to uint8 with one scale per tensor, computed
on every call. This script splits that arithmetic into its parts and measures each alone on the fp32 engine's
portable graph: weights rounded per output channel (activations fp32), and activations rounded per tensor
in one role of GEMM at a time (weights fp32), then both in every GEMM through `quantize_dynamic` itself.
Roles are found by structure: the three projections reading one normalization (the value projection is the
one whose product meets the softmax's), the attention output, FFN up (N = 4K) and FFN down (K = 4N).

Fidelity: cosine of sentence embeddings to the fp32 engine's on the 200 Pang & Lee sentences (padded to
128 tokens, batches of 32), and top-10 nearest-neighbour agreement, judged by the int8 policy's default
encoder target (precision.measure.Target.for_weights: mean >= 0.9995, worst >= 0.999, neighbours >= 95%).

    .venv/bin/python -m benchmarks.encoders.int8_encoder_budget --engine engines/minilm
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper


def encoder_int8_target() -> dict:
    """The int8 policy's default encoder target, as this script judges it: mean and worst sentence cosine
    (the worst at the worst-token bound) and top-10 neighbours."""
    from trtserve.precision.measure import Target

    t = Target.for_weights("int8", "encoder")
    return {"mean": t.min_mean_cosine, "worst": t.min_token_cosine, "neighbours": t.min_neighbours}


def session(path: Path):
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 2, 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def embed(path: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    s = session(path)
    names = {i.name for i in s.get_inputs()}
    out = []
    for a in range(0, len(ids), 32):
        feeds = {"input_ids": ids[a:a + 32], "attention_mask": mask[a:a + 32],
                 "token_type_ids": np.zeros_like(ids[a:a + 32])}
        out.append(s.run(["sentence_embedding"], {k: v for k, v in feeds.items() if k in names})[0])
    e = np.concatenate(out)
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def judge(ref: np.ndarray, out: np.ndarray, target: dict) -> dict:
    from trtserve.precision.measure import neighbour_agreement

    cos = (ref * out).sum(1)
    result = {"mean": float(cos.mean()), "worst": float(cos.min()), "neighbours": neighbour_agreement(ref, out)}
    result["meets"] = all(result[k] >= v for k, v in target.items())
    return result


def roles(model) -> dict[str, str]:
    """GEMM (a MatMul with a weight initializer) -> its role, by structure."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    gemms = [n for n in g.node if n.op_type == "MatMul" and n.input[1] in inits]

    def behind_layout(tensor: str) -> str:  # the op behind a tensor's layout ops
        node = producer.get(tensor)
        while node is not None and node.op_type in ("Reshape", "Transpose", "Cast"):
            node = producer.get(node.input[0])
        return getattr(node, "op_type", "")

    def meets_softmax(node) -> bool:  # its product, through layout ops, is the right side of probs @ V
        frontier = [node.output[0]]
        for _ in range(8):
            nxt = []
            for t in frontier:
                for r in readers.get(t, []):
                    if r.op_type == "MatMul" and r.input[1] == t:
                        return behind_layout(r.input[0]) == "Softmax"
                    if r.op_type in ("Add", "Reshape", "Transpose", "Mul"):
                        nxt.append(r.output[0])
            frontier = nxt
        return False

    out = {}
    for n in gemms:
        k, m = inits[n.input[1]].dims
        shared = [r for r in readers[n.input[0]] if r in gemms]
        if m == 4 * k:
            out[n.name] = "FFN up"
        elif k == 4 * m:
            out[n.name] = "FFN down"
        elif len(shared) == 3:
            out[n.name] = "value projection" if meets_softmax(n) else "query/key projections"
        else:
            out[n.name] = "attention output"
    return out


def weights_per_channel(model) -> None:
    """Every GEMM weight rounded to int8 with one symmetric scale per output channel, in place."""
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.input[1] in inits:
            w = numpy_helper.to_array(inits[n.input[1]])
            d = np.abs(w).max(0, keepdims=True) / 127
            d[d == 0] = 1
            inits[n.input[1]].CopyFrom(numpy_helper.from_array((np.round(w / d) * d).astype(np.float32), n.input[1]))


def activations_per_tensor(model, names: set[str]) -> None:
    """The input of each named GEMM rounded as DynamicQuantizeMatMul rounds it (uint8, one scale per call)."""
    g = model.graph
    for i, n in enumerate([n for n in g.node if n.name in names]):
        a = n.input[0]
        q = helper.make_node("DynamicQuantizeLinear", [a], [f"{a}.q{i}", f"{a}.s{i}", f"{a}.z{i}"])
        dq = helper.make_node("DequantizeLinear", [f"{a}.q{i}", f"{a}.s{i}", f"{a}.z{i}"], [f"{a}.dq{i}"])
        n.input[0] = f"{a}.dq{i}"
        at = list(g.node).index(n)
        g.node.insert(at, dq)
        g.node.insert(at, q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, required=True, help="an fp32 encoder engine directory")
    args = parser.parse_args()
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from tokenizers import Tokenizer

    from trtserve.data.sentiment import polarity

    texts, _ = polarity()
    tok = Tokenizer.from_file(str(args.engine / "tokenizer.json"))
    tok.enable_padding(length=128)
    tok.enable_truncation(128)
    enc = tok.encode_batch(texts)
    ids = np.array([e.ids for e in enc], np.int64)
    mask = np.array([e.attention_mask for e in enc], np.int64)
    source = args.engine / "model.onnx"
    target = encoder_int8_target()
    ref = embed(source, ids, mask)
    role_of = roles(onnx.load(str(source)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "variant.onnx"

        def variant(label: str, edit) -> None:
            model = onnx.load(str(source))
            edit(model)
            onnx.save(model, str(path))
            rows.append((label, judge(ref, embed(path, ids, mask), target)))

        variant("weights int8 per output channel, every GEMM", weights_per_channel)
        for role in sorted(set(role_of.values())):
            chosen = {n for n, r in role_of.items() if r == role}
            variant(f"activations uint8 per tensor, {role} ({len(chosen)})",
                    lambda m, chosen=chosen: activations_per_tensor(m, chosen))
        variant(f"activations uint8 per tensor, every GEMM ({len(role_of)})",
                lambda m: activations_per_tensor(m, set(role_of)))
        quantize_dynamic(source, path, weight_type=QuantType.QInt8, per_channel=True, op_types_to_quantize=["MatMul"])
        rows.append(("quantize_dynamic, every GEMM (both)", judge(ref, embed(path, ids, mask), target)))
    print(f"{args.engine}: 200 Pang & Lee sentences, 128 tokens; target mean >= {target['mean']}, worst >= "
          f"{target['worst']}, neighbours >= {target['neighbours']:.0%}\n")
    print("| int8 arithmetic, alone | mean cosine | worst | top-10 neighbours | meets |\n|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['mean']:.6f} | {r['worst']:.6f} | {r['neighbours']:.1%} | "
              f"{'yes' if r['meets'] else 'no'} |")


if __name__ == "__main__":
    main()

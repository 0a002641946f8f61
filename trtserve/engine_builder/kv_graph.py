"""The ONNX Runtime decode graph: each layer's attention as one GroupQueryAttention node whose past and
present key/value are the same preallocated buffer, so a decode step appends in place instead of copying
the cache (its query, key and value projections one packed GEMM where their weights are fp32 constants);
each RMS norm becomes ONNX Runtime's fused SimplifiedLayerNormalization.

The portable graph keeps the standard contract (left-padded attention_mask, past in, past + new out);
this graph is a lowering of it for ONNX Runtime only, found by the graph's structure (rotary halves,
Concat of past and new, matmul-softmax-matmul), never by names, and checked against the optimized graph
before it is kept. The families' variations are found the same way: per-head q/k norms (a reshape of the
normed heads is added), biases and fused projections (whatever produces q, k and v), partial rotary, a
soft-cap's tanh chain on the scores (the node's softcap), one cos/sin table per rotary base; sliding
windows come from the manifest's per-layer windows (local_window_size).
Its contract, per sequence slot b of the buffers (slots, Hkv, capacity, D):
  input_ids (B, S)       new tokens, right-padded: rows [0, query_seqlens[b]) are real
  query_seqlens (B,)     new tokens of row b this call (0: the row is idle, its cache unchanged)
  seqlens_k (B,)         tokens in row b's cache after this call, minus one
  total_sequence_length  the largest seqlens_k + 1 of the call (a scalar)
  logit_index (B, K)     the positions of each row whose logits are wanted
  past_key_values.*      the buffers, bound as present.* too (ONNX Runtime writes the new rows in place)
Positions are the cache positions: a row's tokens start at 0, with no padding in front.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trtserve.engine_builder.onnxruntime import write_optimized
from trtserve.graph_files import data_path, load_graph, save_graph, save_structure
from trtserve.graph_index import GraphIndex, attr, prune
from trtserve.runtime.kv_slots import KV_GRAPH, LOGIT_INDEX, QUERY_LENS, SEQLENS, TOTAL

CAPACITY_AXIS = "capacity"


class NotLowered(Exception):
    """The graph does not have the structure the lowering needs; the message says what was missing."""


class _Graph(GraphIndex):
    """The graph's index (graph_index.GraphIndex), and the producer a lowering expects or refuses by name."""

    def node(self, tensor: str, op: str, what: str):
        found = self.producer.get(tensor)
        if found is None or found.op_type != op:
            raise NotLowered(f"{what}: expected {op} producing {tensor}, found {found.op_type if found else 'none'}")
        return found


def _heads_view(g: _Graph, tensor: str, what: str) -> str:
    """x (B, S, H*D) of a heads view (B, H, S, D): the input of Transpose(0, 2, 1, 3)(Reshape(x)) where the
    graph has it; otherwise (a per-head norm between the two, or after the transpose) a new Transpose and
    Reshape of the view."""
    transpose = g.producer.get(tensor)
    if transpose is not None and transpose.op_type == "Transpose" and list(attr(transpose, "perm", [])) == [0, 2, 1, 3]:
        inner = g.producer.get(transpose.input[0])
        if inner is not None and inner.op_type == "Reshape":
            return inner.input[0]
        return _flatten(g, transpose.input[0])
    swapped = f"{tensor}.kv.bshd"
    g.graph.node.append(helper.make_node("Transpose", [tensor], [swapped], name=swapped, perm=[0, 2, 1, 3]))
    return _flatten(g, swapped)


def _flatten(g: _Graph, tensor: str) -> str:
    """Reshape (B, S, H, D) -> (B, S, H*D) as a new node (placed by graph_index.prune's ordering)."""
    if "kv.flat_shape" not in g.inits:
        g.inits["kv.flat_shape"] = numpy_helper.from_array(np.array([0, 0, -1], np.int64), "kv.flat_shape")
        g.graph.initializer.append(g.inits["kv.flat_shape"])
    flat = f"{tensor}.kv.flat"
    g.graph.node.append(helper.make_node("Reshape", [tensor, "kv.flat_shape"], [flat], name=flat))
    return flat


def _rotated(g: _Graph, tensor: str, head: int, what: str) -> tuple[str, str, str, int]:
    """The rotary embedding of x (B, H, S, D) on all D, or on its first R dims with the rest passed through
    (Concat(rotary(x[..., :R]), x[..., R:]), partial rotary) -> (x, cos, sin, R)."""
    cat = g.producer.get(tensor)
    if cat is None or cat.op_type != "Concat":
        x, cos, sin, dims = _rotary(g, tensor, what)
        if dims != head:
            raise NotLowered(f"{what}: the rotary embedding covers {dims} of {head} dims without a pass-through")
        return x, cos, sin, dims
    if len(cat.input) != 2 or attr(cat, "axis") not in (-1, 3):
        raise NotLowered(f"{what}: {cat.name} is not a partial rotary concat")
    part, cos, sin, dims = _rotary(g, cat.input[0], what)
    first, rest = g.node(part, "Slice", what), g.node(cat.input[1], "Slice", what)
    bounds: list = [(g.const(s.input[1]), g.const(s.input[2])) for s in (first, rest)]  # None: checked below
    if (first.input[0] != rest.input[0] or any(a is None or b is None for a, b in bounds)
            or int(bounds[0][0].ravel()[0]) != 0 or int(bounds[0][1].ravel()[0]) != dims
            or int(bounds[1][0].ravel()[0]) != dims or int(bounds[1][1].ravel()[0]) < head):
        raise NotLowered(f"{what}: the partial rotary does not split x into [:{dims}] and [{dims}:]")
    return first.input[0], cos, sin, dims


def _rotary(g: _Graph, tensor: str, what: str) -> tuple[str, str, str, int]:
    """x * cos + cat(-x[..., R/2:], x[..., :R/2]) * sin -> (x, cos, sin, R)."""
    add = g.node(tensor, "Add", what)
    muls: list = [g.producer.get(i) for i in add.input]  # None: checked below
    if any(m is None or m.op_type != "Mul" for m in muls):
        raise NotLowered(f"{what}: {add.name} does not add two products")
    for rotated, plain in (muls, muls[::-1]):
        for slot in (0, 1):
            cat = g.producer.get(rotated.input[slot])
            if cat is None or cat.op_type != "Concat" or len(cat.input) != 2:
                continue
            neg = g.producer.get(cat.input[0])
            first, second = (g.producer.get(neg.input[0]) if neg is not None and neg.op_type == "Neg" else None,
                             g.producer.get(cat.input[1]))
            if first is None or second is None or first.op_type != "Slice" or second.op_type != "Slice":
                continue
            x = first.input[0]
            if second.input[0] != x or x not in plain.input:
                continue
            halves: list = [(g.const(s.input[1]), g.const(s.input[2])) for s in (first, second)]  # None: checked
            if any(a is None or b is None for a, b in halves):
                continue
            (s1, _), (s2, e2) = halves
            half = int(s1.ravel()[0])
            if int(s2.ravel()[0]) != 0 or int(e2.ravel()[0]) != half:
                raise NotLowered(f"{what}: the rotary halves are not [:{half}] and [{half}:]")
            sin = rotated.input[1 - slot]
            cos = plain.input[1 - list(plain.input).index(x)]
            return x, cos, sin, 2 * half
    raise NotLowered(f"{what}: no rotate-half pattern under {add.name}")


def _inv_freq(g: _Graph, cos: str, sin: str) -> tuple[np.ndarray, float]:
    """Unsqueeze(Cos(Concat(f, f)) [* a]) with f = positions * inv_freq, the same f and factor a under sin ->
    (inv_freq, a)."""
    roots, factors = [], []
    for tensor, op in ((cos, "Cos"), (sin, "Sin")):
        inner = g.producer.get(g.node(tensor, "Unsqueeze", "rotary table").input[0])
        factor = 1.0
        if inner is not None and inner.op_type == "Mul":
            values = [g.const(i) for i in inner.input]
            if sum(v is not None and v.size == 1 for v in values) != 1:
                raise NotLowered("rotary table: cos and sin are scaled by something other than one constant")
            factor = float(next(v for v in values if v is not None).ravel()[0])
            inner = g.producer.get(next(i for i, v in zip(inner.input, values) if v is None))
        factors.append(factor)
        if inner is None or inner.op_type != op:
            raise NotLowered(f"rotary table: expected {op}, found {inner.op_type if inner else 'none'}")
        cat = g.node(inner.input[0], "Concat", "rotary table")
        if len(cat.input) != 2 or cat.input[0] != cat.input[1]:
            raise NotLowered("rotary table: the angles are not cat(freqs, freqs)")
        roots.append(cat.input[0])
    if roots[0] != roots[1] or factors[0] != factors[1]:
        raise NotLowered("rotary table: cos and sin read different angles")
    mul = g.node(roots[0], "Mul", "rotary table")
    values = [g.const(i) for i in mul.input]
    found = [v for v in values if v is not None]
    if len(found) != 1:
        raise NotLowered("rotary table: the angles are not positions times one constant frequency vector")
    return found[0].astype(np.float64).ravel(), factors[0]


def _layer(g: _Graph, i: int, head: int) -> dict:
    what = f"layer {i}"
    cat_k = g.node(f"present.{i}.key", "Concat", what)
    cat_v = g.node(f"present.{i}.value", "Concat", what)
    if cat_k.input[0] != f"past_key_values.{i}.key" or cat_v.input[0] != f"past_key_values.{i}.value":
        raise NotLowered(f"{what}: the presents are not past + new")
    k, cos, sin, dims = _rotated(g, cat_k.input[1], head, what + " key")
    k_flat, v_flat = _heads_view(g, k, what + " key"), _heads_view(g, cat_v.input[1], what + " value")
    pv = [n for n in g.readers.get(f"present.{i}.value", []) if n.op_type == "MatMul"]
    tk = [n for n in g.readers.get(f"present.{i}.key", []) if n.op_type == "Transpose"]
    if len(pv) != 1 or len(tk) != 1 or list(attr(tk[0], "perm", [])) != [0, 1, 3, 2]:
        raise NotLowered(f"{what}: no single scores and values product on the presents")
    qk = [n for n in g.readers.get(tk[0].output[0], []) if n.op_type == "MatMul"]
    if len(qk) != 1:
        raise NotLowered(f"{what}: no single query-key product")
    q_rot = g.node(qk[0].input[0], "Reshape", what + " query").input[0]
    q, q_cos, q_sin, _ = _rotated(g, q_rot, head, what + " query")
    if (q_cos, q_sin) != (cos, sin):
        raise NotLowered(f"{what}: query and key use different rotary tables")
    q_flat = _heads_view(g, q, what + " query")
    scaled = [n for n in g.readers.get(qk[0].output[0], []) if n.op_type == "Mul"]
    scale = g.const(next(x for x in scaled[0].input if x != qk[0].output[0])) if len(scaled) == 1 else None
    if scale is None or scale.size != 1:
        raise NotLowered(f"{what}: the scores are not scaled by one constant")
    scores, softcap = _soft_cap(g, scaled[0].output[0], what)
    probs = g.node(g.node(pv[0].input[0], "Reshape", what).input[0], "Softmax", what)
    if attr(probs, "axis", -1) != -1:
        raise NotLowered(f"{what}: softmax is not over the keys")
    masked = g.node(probs.input[0], "Add", what + " mask")
    reshaped = [g.producer.get(t) for t in masked.input]
    if not any(r is not None and r.op_type == "Reshape" and r.input[0] == scores for r in reshaped):
        raise NotLowered(f"{what}: the softmax does not read the scaled scores plus a mask")
    out = pv[0].output[0]
    for op in ("Reshape", "Transpose", "Reshape"):
        readers = g.readers.get(out, [])
        if len(readers) != 1 or readers[0].op_type != op:
            raise NotLowered(f"{what}: the attention output is not reshaped back to (B, S, H*D)")
        out = readers[0].output[0]
    return {"q": q_flat, "k": k_flat, "v": v_flat, "out": out, "scale": float(scale.ravel()[0]), "cos": cos, "sin": sin,
            "rotary_dims": dims, "softcap": softcap, "drop": [g.producer[out], cat_k, cat_v]}


def _soft_cap(g: _Graph, scores: str, what: str) -> tuple[str, float]:
    """Mul(Tanh(Div(s, c)), c) on the scaled scores (Gemma 2) -> (its output, c); (scores, 0.0) without one."""
    readers = g.readers.get(scores, [])
    if len(readers) != 1 or readers[0].op_type != "Div":
        return scores, 0.0
    div = readers[0]
    cap = g.const(div.input[1])
    tanh = _only_reader(g, div.output[0], "Tanh")
    mul = _only_reader(g, tanh.output[0], "Mul")
    again = g.const(next((t for t in mul.input if t != tanh.output[0]), ""))
    if (cap is None or again is None or cap.size != 1 or again.size != 1
            or float(cap.ravel()[0]) != float(again.ravel()[0])):
        raise NotLowered(f"{what}: the scores go through a tanh that is not a soft cap tanh(s / c) * c")
    return mul.output[0], float(cap.ravel()[0])


def _packed_qkv(g: _Graph, f: dict, i: int) -> list[str]:
    """GroupQueryAttention's query, key and value inputs. Where the three are products of one input with fp32
    weight constants, they become one product with the weights side by side (GroupQueryAttention's packed
    form: key and value empty), one GEMM instead of three per layer. Where they already are one product split
    three ways along its last axis (quantized weights fused by precision.blocked), the attention reads that
    product whole and the Split goes. Otherwise the three as they are."""
    products: list = [g.producer.get(f[t]) for t in ("q", "k", "v")]  # None: checked below
    split = products[0]
    if split is not None and split.op_type == "Split" and list(split.output) == [f["q"], f["k"], f["v"]] \
            and attr(split, "axis", 0) in (-1, 2):
        return [split.input[0], "", ""]
    if any(p is None or p.op_type != "MatMul" for p in products) or len({p.input[0] for p in products}) != 1:
        return [f["q"], f["k"], f["v"]]
    weights: list = [g.const(p.input[1]) for p in products]  # None: checked below
    if any(w is None or w.ndim != 2 or w.dtype != np.float32 for w in weights):
        return [f["q"], f["k"], f["v"]]
    name = f"kv.qkv_weight.{i}"
    g.graph.initializer.append(numpy_helper.from_array(np.concatenate(weights, axis=1), name))
    g.graph.node.insert(list(g.graph.node).index(products[0]) + 1, helper.make_node(
        "MatMul", [products[0].input[0], name], [f"kv.qkv.{i}"], name=f"attention.{i}.qkv"))
    return [f"kv.qkv.{i}", "", ""]


def _logit_gather(g: _Graph) -> None:
    """Transpose(1,0,2) -> GatherND(Unsqueeze(logit_positions)) -> Transpose(1,0,2) becomes a gather of
    each row's own positions: GatherND(hidden, Unsqueeze(logit_index, -1), batch_dims=1)."""
    users = g.readers.get("logit_positions", [])
    if len(users) != 1 or users[0].op_type != "Unsqueeze":
        raise NotLowered("the logit positions are not read by one Unsqueeze")
    gathers = g.readers.get(users[0].output[0], [])
    if len(gathers) != 1 or gathers[0].op_type != "GatherND":
        raise NotLowered("the logit positions do not select hidden rows by GatherND")
    hidden = g.node(gathers[0].input[0], "Transpose", "logit gather").input[0]
    after = g.readers.get(gathers[0].output[0], [])
    if len(after) != 1 or after[0].op_type != "Transpose":
        raise NotLowered("the gathered rows are not transposed back")
    axes = helper.make_tensor(f"{LOGIT_INDEX}.axes", TensorProto.INT64, [1], [-1])
    g.graph.initializer.append(axes)
    index = list(g.graph.node).index(after[0])
    for node in (after[0], gathers[0], users[0]):
        g.graph.node.remove(node)
    g.graph.node.insert(index, helper.make_node("GatherND", [hidden, f"{LOGIT_INDEX}.index"], [after[0].output[0]],
                                                name="logit_gather", batch_dims=1))
    g.graph.node.insert(index, helper.make_node("Unsqueeze", [LOGIT_INDEX, axes.name], [f"{LOGIT_INDEX}.index"],
                                                name="logit_index.unsqueeze"))


def _rms_norms(g: _Graph) -> int:
    """weight * (x * 1 / sqrt(mean(x^2) + eps)) -> SimplifiedLayerNormalization(x, weight): ONNX Runtime's
    fused RMS norm (its own optimizer then joins a residual Add before it into SkipSimplifiedLayerNormalization).
    Returns how many were fused."""
    fused = 0
    for pow_ in [n for n in g.graph.node if n.op_type == "Pow"]:
        two = g.const(pow_.input[1])
        if two is None or two.size != 1 or float(two.ravel()[0]) != 2.0:
            continue
        x = pow_.input[0]
        try:
            mean = _only_reader(g, pow_.output[0], "ReduceMean")
            add = _only_reader(g, mean.output[0], "Add")
            sqrt = _only_reader(g, add.output[0], "Sqrt")
            reciprocal = _only_reader(g, sqrt.output[0], "Reciprocal")
            scaled = _only_reader(g, reciprocal.output[0], "Mul")
            weighted = _only_reader(g, scaled.output[0], "Mul")
        except NotLowered:
            continue
        axes = g.const(mean.input[1]) if len(mean.input) > 1 else np.array(attr(mean, "axes", []))
        eps = g.const(next((i for i in add.input if i != mean.output[0]), ""))
        weight = next(i for i in weighted.input if i != scaled.output[0])
        w = g.const(weight)
        if (axes is None or axes.ravel().tolist() != [-1] or attr(mean, "keepdims", 1) != 1 or eps is None
                or eps.size != 1 or x not in scaled.input or w is None or w.ndim != 1):
            continue
        index = list(g.graph.node).index(weighted)
        g.graph.node.remove(weighted)
        g.graph.node.insert(index, helper.make_node("SimplifiedLayerNormalization", [x, weight], [weighted.output[0]],
                                                    name=f"{weighted.name or weighted.output[0]}.rms_norm", axis=-1,
                                                    epsilon=float(eps.ravel()[0]), stash_type=1))
        fused += 1
    return fused


def _only_reader(g: _Graph, tensor: str, op: str):
    readers = g.readers.get(tensor, [])
    if len(readers) != 1 or readers[0].op_type != op:
        raise NotLowered(f"{tensor} is not read by one {op}")
    return readers[0]


def lower(model: onnx.ModelProto, heads: int, kv_heads: int, head: int, capacity: int,
          windows: list[int | None] | None = None, base: Path | None = None) -> onnx.ModelProto:
    """The decode graph of a portable decoder graph (a copy); NotLowered says why it cannot be made.
    `windows`: per layer, the sliding window of the model (keys q - w < k <= q) or None. `base`: the folder
    the graph's external weights are in (a graph loaded without them)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # no serialization: a graph holding its weights may be past protobuf's 2 GB
    model = copy
    graph = model.graph
    g = _Graph(graph, base)
    layers = sorted({int(o.name.split(".")[1]) for o in graph.output if o.name.startswith("present.")})
    if not layers:
        raise NotLowered("the graph has no present key/value outputs")
    float_inputs = [i for i in graph.input if i.name.startswith("past_key_values.")]
    if any(i.type.tensor_type.elem_type != TensorProto.FLOAT for i in float_inputs):
        raise NotLowered("the cache is not float32")
    found = [_layer(g, i, head) for i in layers]
    _logit_gather(g)
    _rms_norms(g)
    tables: dict[tuple, str] = {}  # one cos/sin cache per distinct rotary table (Gemma 3: local and global)
    for i, f in zip(layers, found):
        inv_freq, factor = _inv_freq(g, f["cos"], f["sin"])
        if inv_freq.size != f["rotary_dims"] // 2:
            raise NotLowered(f"layer {i}: the rotary frequencies have {inv_freq.size} entries, not "
                             f"{f['rotary_dims'] // 2}")
        if inv_freq.size % 8:
            raise NotLowered(f"layer {i}: GroupQueryAttention needs the rotary half-width to be a multiple of 8, "
                             f"not {inv_freq.size}")
        key = (tuple(inv_freq.tolist()), factor)
        if key not in tables:
            tables[key] = f"kv.rotary.{len(tables)}"
            angles = np.arange(capacity, dtype=np.float64)[:, None] * inv_freq[None, :]
            graph.initializer.extend([
                numpy_helper.from_array((np.cos(angles) * factor).astype(np.float32), tables[key] + ".cos"),
                numpy_helper.from_array((np.sin(angles) * factor).astype(np.float32), tables[key] + ".sin")])
        qkv = _packed_qkv(g, f, i)
        index = list(graph.node).index(f["drop"][0])
        for node in f["drop"]:
            graph.node.remove(node)
        window = windows[i] if windows else None
        extra = {"softcap": f["softcap"]} if f["softcap"] else {}
        graph.node.insert(index, helper.make_node(
            "GroupQueryAttention",
            [*qkv, f"past_key_values.{i}.key", f"past_key_values.{i}.value", SEQLENS, TOTAL,
             tables[key] + ".cos", tables[key] + ".sin", "", "", "", "", "", "", "", QUERY_LENS],
            [f["out"], f"present.{i}.key", f"present.{i}.value"], name=f"attention.{i}", domain="com.microsoft",
            num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0, scale=f["scale"],
            local_window_size=window if window else -1, **extra))
    prune(graph)
    keep = [i for i in graph.input if i.name in {"input_ids"} or i.name.startswith("past_key_values.")]
    used = {name for n in graph.node for name in n.input}
    if any(i.name in used for i in graph.input if i not in keep and i.name != "logit_positions"):
        raise NotLowered("the graph still reads the attention mask or positions after the lowering")
    del graph.input[:]
    graph.input.extend([keep[0],
                        helper.make_tensor_value_info(QUERY_LENS, TensorProto.INT32, ["batch"]),
                        helper.make_tensor_value_info(SEQLENS, TensorProto.INT32, ["batch"]),
                        helper.make_tensor_value_info(TOTAL, TensorProto.INT32, []),
                        helper.make_tensor_value_info(LOGIT_INDEX, TensorProto.INT64, ["batch", "logit_positions"]),
                        *keep[1:]])
    for value in list(graph.input) + list(graph.output):
        if value.name.startswith(("past_key_values.", "present.")):
            value.type.tensor_type.shape.dim[2].dim_param = CAPACITY_AXIS
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


CHECK_LENGTHS = (5, 17, 2)  # prompts of the build check; the second is fed in two chunks while the others idle
CHECK_STEPS = 4
CHECK_TOLERANCE = 5e-3  # largest logit difference allowed, relative to the largest logit


def build_kv(tmp: Path, manifest) -> dict:
    """Write the decode graph beside the optimized one and check it against that graph; return the backend
    entry's `kv_graph` record ({"file": None, "why_not": ...} when it cannot be made or misses the check).
    `manifest`: the engine's so far (typed, or the dict the build is composing)."""
    import onnxruntime as ort

    from trtserve.engine_builder.onnxruntime import OPTIMIZED
    from trtserve.engine_dir import as_manifest

    manifest = as_manifest(manifest)
    arch = manifest.model.architecture
    capacity = manifest.shapes.total_sequence.max
    try:
        lowered = lower(load_graph(tmp / manifest.onnx.file, weights=False), arch.num_heads, arch.num_kv_heads,
                        arch.head_dim, capacity, arch.sliding_windows, base=tmp)
    except NotLowered as exc:
        return {"file": None, "why_not": str(exc)}
    staged, out = tmp / "kv.portable.onnx", tmp / KV_GRAPH
    save_graph(lowered, staged)
    del lowered
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    write_optimized(options, out)
    options.log_severity_level = 3
    try:
        ort.InferenceSession(str(staged), options, providers=["CPUExecutionProvider"])
        _remove_graph(staged)
        _same_lowerings(tmp / OPTIMIZED, out)
        check = _checked_without_rounding(tmp, manifest)
    except RuntimeError as exc:  # ONNX Runtime refused the lowered graph: the engine keeps the portable one
        for path in (staged, out):
            _remove_graph(path)
        return {"file": None, "why_not": f"ONNX Runtime could not run the decode graph: {str(exc).splitlines()[0]}"}
    if check.get("lowerings_differ"):
        _remove_graph(out)
        return {"file": None, "why_not": "the decode graph's activation roundings differ from the optimized graph's "
                                         f"at {', '.join(check['lowerings_differ'][:3])}"}
    if check["max_relative_difference"] > CHECK_TOLERANCE:
        _remove_graph(out)
        return {"file": None,
                "why_not": f"logits differ from the optimized graph by {check['max_relative_difference']:.2e} "
                           f"of the largest (allowed {CHECK_TOLERANCE:g})", "check": check}
    return {"file": KV_GRAPH, "capacity": capacity, "check": check}


def _remove_graph(path: Path) -> None:
    for file in (path, data_path(path)):
        file.unlink(missing_ok=True)


def _checked_without_rounding(tmp: Path, manifest) -> dict:
    """check_kv on the two graphs as written, or, where they round GEMM activations, on copies of both with fp32
    activations: the check is of the attention and cache lowering, which rounding would hide behind its own
    sensitivity (activation_residual.without_rounded_activations), once each node's rounding is found the same in
    both (a check that reports `lowerings_differ` otherwise)."""
    import tempfile

    from trtserve.engine_builder.activation_residual import activation_lowerings, without_rounded_activations
    from trtserve.engine_builder.onnxruntime import OPTIMIZED

    main = onnx.load(str(tmp / OPTIMIZED), load_external_data=False)
    kv = onnx.load(str(tmp / KV_GRAPH), load_external_data=False)
    lowerings = activation_lowerings(main), activation_lowerings(kv)
    if lowerings[0] != lowerings[1]:
        differ = sorted(name for name in lowerings[0].keys() | lowerings[1].keys()
                        if lowerings[0].get(name) != lowerings[1].get(name))
        return {"max_relative_difference": float("inf"), "lowerings_differ": differ}
    if not without_rounded_activations(main):
        return check_kv(tmp, manifest)
    with tempfile.TemporaryDirectory(dir=tmp) as scratch:
        for name in (OPTIMIZED, KV_GRAPH):
            model = load_graph(tmp / name, weights=False)
            without_rounded_activations(model)
            save_graph(model, Path(scratch) / name, base=tmp)
        return dict(check_kv(Path(scratch), manifest), activations="fp32 in both graphs for the check")


def _same_lowerings(main: Path, kv: Path) -> None:
    """Give the decode graph the optimized graph's ONNX-Runtime-only lowerings: each MatMulNBits node's accuracy
    level and residual rows (nodes keep their names through the lowering) and GatherBlockQuantized tables."""
    from trtserve.engine_builder.activation_residual import add_residual_rows, residual_gemms
    from trtserve.engine_builder.onnxruntime import _gather_block_quantized, set_accuracy_level

    main_model = onnx.load(str(main), load_external_data=False)
    nodes = main_model.graph.node
    levels = {n.name: attr(n, "accuracy_level") for n in nodes if n.op_type == "MatMulNBits"}
    gathers = any(n.op_type == "GatherBlockQuantized" for n in nodes)
    residual = residual_gemms(main_model)
    model = load_graph(kv, weights=bool(gathers or residual))  # those two rewrite weights; the levels do not
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and levels.get(node.name) is not None:
            set_accuracy_level(node, levels[node.name])
    add_residual_rows(model, residual)
    if gathers:
        _gather_block_quantized(model)
    (save_graph if gathers or residual else save_structure)(model, kv)


def check_kv(tmp: Path, manifest) -> dict:
    """Random prompts through the slots (batched, right-padded, one prompt in two chunks beside idle rows, then
    decode steps) against each prompt alone through the optimized graph, on the same tokens."""
    import gc

    from trtserve.engine_dir import EngineDir
    from trtserve.runtime import generate
    from trtserve.runtime.kv_slots import KVSlots
    from trtserve.runtime.ort import OrtBackend

    engine = EngineDir(tmp, manifest)
    vocab = engine.manifest.model.architecture.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, n) for n in CHECK_LENGTHS]
    slots = KVSlots(engine, len(prompts), threads=2)
    rows, longest = len(prompts), max(CHECK_LENGTHS)
    first = [n if i != 1 else n // 2 for i, n in enumerate(CHECK_LENGTHS)]
    ids = np.zeros((rows, longest), np.int64)
    for i, p in enumerate(prompts):
        ids[i, :first[i]] = p[:first[i]]
    logits = slots.run(0, ids, np.array(first), np.maximum(np.array(first) - 1, 0)[:, None])[:, 0]
    rest = CHECK_LENGTHS[1] - first[1]
    chunk = np.zeros((rows, rest), np.int64)
    chunk[1] = prompts[1][first[1]:]
    logits[1] = slots.run(0, chunk, np.array([0, rest, 0]), np.array([[0], [rest - 1], [0]]))[1, 0]
    steps = [logits]
    for _ in range(CHECK_STEPS - 1):
        tokens = steps[-1].argmax(-1)
        steps.append(slots.run(0, tokens[:, None], np.ones(rows, np.int64), np.zeros((rows, 1), np.int64))[:, 0])
    got = np.stack(steps, 1)  # (rows, steps, V)
    del slots  # one graph's weights in memory at a time: the slots' session goes before the optimized graph's
    gc.collect()
    backend = OrtBackend(engine, threads=2)
    worst = 0.0
    try:
        for i, p in enumerate(prompts):
            forced = got[i].argmax(-1)[None]
            _, want = generate.greedy(backend, p[None], np.ones((1, len(p)), np.int64), CHECK_STEPS, forced=forced)
            worst = max(worst, float(np.abs(got[i] - want[0]).max() / np.abs(want[0]).max()))
    finally:
        backend.close()
    return {"prompts": list(CHECK_LENGTHS), "steps": CHECK_STEPS, "max_relative_difference": worst}

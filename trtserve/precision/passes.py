"""Write a precision policy into an ONNX graph: fp16 initializers, Cast nodes at the borders.

Rules, in order, for each node (graph order is topological):
  1. Shape/Size and nodes without float inputs or outputs are left alone.
  2. Nodes in a protected pattern, named in the policy, or of an fp32 op type stay fp32.
  3. Anchor ops (hybrid: GEMMs; fp16: every float op) run in the low type, unless a constant
     they read does not fit it (never clamp silently).
  4. Movement and elementwise ops follow their inputs: low only when every float activation
     they read is already low (or, for an initializer-only node such as an embedding lookup,
     when the initializer is a GEMM weight stored low anyway).
A Cast is inserted only on an edge whose two ends differ, and shared per (tensor, type), so no
fp32 -> fp16 -> fp32 round trip appears between adjacent fp32 nodes. Graph inputs and outputs
stay fp32.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from trtserve.graph_index import GraphIndex
from trtserve.precision.policy import Policy

FP16_MAX = 65504.0
CAST_ANY_INPUT = {"Shape", "Size", "Cast"}


@dataclass
class PassReport:
    low_nodes: Counter = field(default_factory=Counter)
    fp32_nodes: Counter = field(default_factory=Counter)
    patterns: dict = field(default_factory=dict)
    casts_inserted: int = 0
    initializers_low: int = 0
    initializers_fp32: int = 0
    kept_fp32_unrepresentable: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "low_precision_nodes": dict(sorted(self.low_nodes.items())),
            "fp32_nodes": dict(sorted(self.fp32_nodes.items())),
            "patterns_kept_fp32": self.patterns,
            "casts_inserted": self.casts_inserted,
            "initializers_low": self.initializers_low,
            "initializers_fp32": self.initializers_fp32,
            "kept_fp32_unrepresentable_constant": self.kept_fp32_unrepresentable[:20],
        }


class _Graph(GraphIndex):
    """The graph's index (graph_index.GraphIndex) and what the precision passes ask of it: float tensors, and
    whether an initializer fits fp16."""

    home: dict[str, int]  # tensor -> its element type, set by _decide
    anchored: set[str]  # initializers an anchor op reads, set by _decide

    def __init__(self, model) -> None:
        from onnx import TensorProto

        super().__init__(model.graph)
        self.g = model.graph
        self.FLOAT, self.HALF = TensorProto.FLOAT, TensorProto.FLOAT16
        self.consumers = self.readers
        self._absmax: dict[str, float] = {}

    def is_float(self, name: str) -> bool:
        return bool(name) and self.types.get(name) == self.FLOAT

    def fits(self, name: str) -> bool:
        if name not in self._absmax:
            array = self.const(name)
            assert array is not None  # asked of initializers only
            self._absmax[name] = float(np.abs(array).max()) if array.size else 0.0
        return self._absmax[name] <= FP16_MAX


def name_nodes(graph) -> None:
    seen = set()
    for i, node in enumerate(graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)


def find_patterns(model, names) -> dict[str, list[set[str]]]:
    """Instances (sets of node names) of each structural pattern in `names`."""
    if any(not node.name for node in model.graph.node):
        copy = type(model)()
        copy.CopyFrom(model)
        name_nodes(copy.graph)
        model = copy
    index = _Graph(model)
    finders = {"rmsnorm": _rmsnorm, "rotary": _rotary, "attention_mask": _attention_mask}
    return {name: finders[name](index) for name in names}


def _only_consumer(index: _Graph, node, op_types):
    users = [c for out in node.output for c in index.consumers[out]]
    return users[0] if len(users) == 1 and users[0].op_type in op_types else None


def _rmsnorm(index: _Graph) -> list[set[str]]:
    """x * 1/sqrt(mean(x^2) + eps) * w, exported decomposed: Pow -> ReduceMean -> Add -> Sqrt -> Reciprocal|Div."""
    from onnx import numpy_helper

    found = []
    for node in index.g.node:
        if node.op_type != "Pow" or node.input[1] not in index.inits:
            continue
        if float(numpy_helper.to_array(index.inits[node.input[1]])) != 2.0:
            continue
        chain, current = [node], node
        for ops in ({"ReduceMean"}, {"Add"}, {"Sqrt"}, {"Reciprocal", "Div"}):
            current = _only_consumer(index, current, ops)
            if current is None:
                break
            chain.append(current)
        if current is None:
            continue
        # the normalising Mul(x, r) and the weight Mul after it
        for mul in index.consumers[current.output[0]]:
            if mul.op_type == "Mul":
                chain.append(mul)
                chain += [c for c in index.consumers[mul.output[0]] if c.op_type == "Mul"]
        found.append({n.name for n in chain})
    return found


def _rotary(index: _Graph) -> list[set[str]]:
    """Everything that computes the angles fed to Cos/Sin (positions x inv_freq), and Cos/Sin."""
    trig = [n for n in index.g.node if n.op_type in ("Cos", "Sin")]
    if not trig:
        return []
    chain, stack = set(), list(trig)
    while stack:
        node = stack.pop()
        if node.name in chain:
            continue
        chain.add(node.name)
        stack += [index.producer[i] for i in node.input if i in index.producer]
    return [chain]


def _attention_mask(index: _Graph) -> list[set[str]]:
    """Arithmetic on the attention mask, up to and including where it meets the scores."""
    source = next((v.name for v in index.g.input if v.name == "attention_mask"), None)
    if source is None:
        return []
    pure, chain, frontier = {source}, set(), [source]
    while frontier:
        tensor = frontier.pop()
        for node in index.consumers[tensor]:
            if node.op_type in ("Shape", "Size"):
                continue
            chain.add(node.name)
            # float activations from elsewhere (the scores) end the chain; integer and boolean
            # tensors (causal structure built from shapes) do not
            activations = [i for i in node.input if index.is_float(i) and i not in index.inits]
            if all(i in pure for i in activations):
                for out in node.output:
                    if out not in pure:
                        pure.add(out)
                        frontier.append(out)
    return [chain]


LIGHT_BYTES = 1 << 16  # initializers larger than this are set aside during shape inference


def infer_shapes(model, data_prop: bool = False, in_place: bool = False):
    """onnx shape inference on a copy of `model` (on `model` itself with `in_place`), without passing its
    large weights through protobuf serialization (twice per call, seconds for a 500 MB graph): only
    their types and dims matter, so inference runs on a copy whose large initializers hold no bytes."""
    import onnx

    if in_place:  # types from before a rewrite must not constrain the new inference
        del model.graph.value_info[:]
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)
    for tensor in skeleton.graph.initializer:
        if tensor.ByteSize() > LIGHT_BYTES and tensor.HasField("raw_data"):
            tensor.ClearField("raw_data")
    inferred = onnx.shape_inference.infer_shapes(skeleton, data_prop=data_prop)
    del skeleton
    out = model if in_place else onnx.ModelProto()
    if not in_place:
        out.CopyFrom(model)
    del out.graph.value_info[:]
    out.graph.value_info.extend(inferred.graph.value_info)
    del out.graph.output[:]
    out.graph.output.extend(inferred.graph.output)
    return out


def plan_policy(model, policy: Policy):
    """Decide every node's precision. Returns (model with types inferred, index, low, home, report)."""
    model = infer_shapes(model, data_prop=True)
    name_nodes(model.graph)
    report = PassReport()
    index = _Graph(model)
    if policy.name == "fp32":
        return model, index, {n.name: False for n in model.graph.node}, {}, report
    patterns = find_patterns(model, policy.fp32_patterns)
    report.patterns = {name: {"instances": len(v), "nodes": sum(map(len, v))} for name, v in patterns.items()}
    protected = set(policy.fp32_nodes).union(*[s for sets in patterns.values() for s in sets])
    low = _decide(index, policy, protected, report)
    home = _initializer_types(index, low, report)
    return model, index, low, home, report


def apply_policy(model, policy: Policy):
    """Return (mixed model, PassReport): fp16 initializers and Casts. The input is not modified."""
    model, index, low, home, report = plan_policy(model, policy)
    if policy.name == "fp32":
        return model, report
    _rewrite(model, index, low, home, report)
    return infer_shapes(model, in_place=True), report


def emulation_model(model, policy: Policy):
    """An fp32 graph that rounds every low-precision node's inputs and outputs through fp16.

    ONNX Runtime on the CPU runs fp16 nodes in fp32 and drops the casts between them, which
    hides fp16 overflow. Explicit Cast(fp16)->Cast(fp32) pairs survive its optimizer, so this
    graph reproduces per-op fp16 rounding and overflow (to inf) with fp32 accumulation inside
    GEMMs and reductions, as fp16 kernels on a GPU do.
    """
    model, index, low, home, _ = plan_policy(model, policy)
    if policy.name != "fp32":
        _rewrite_emulated(model, index, low, home)
    return infer_shapes(model, in_place=True)


def _decide(index: _Graph, policy: Policy, protected: set, report: PassReport) -> dict[str, bool]:
    """Node name -> runs in the low type. Fills index.home for activations."""
    home: dict[str, int]
    low, home = {}, {}
    anchored = set()
    for node in index.g.node:
        if (policy.everything or node.op_type in policy.anchors) and node.name not in protected:
            anchored |= _weights_behind(index, node, policy.follow)
        elif policy.low_embeddings and node.op_type == "Gather" and node.input[0] in index.inits:
            anchored |= {node.input[0]} if index.fits(node.input[0]) else set()
    for node in index.g.node:
        float_ins = [i for i in node.input if index.is_float(i)]
        float_outs = [o for o in node.output if index.is_float(o)]
        inits = [i for i in float_ins if i in index.inits]
        fits = all(index.fits(i) for i in inits)
        decision = False
        if node.op_type in ("Shape", "Size") or not (float_ins or float_outs):
            decision = False
        elif node.name in protected or node.op_type in policy.fp32_ops:
            decision = False
        elif policy.everything or node.op_type in policy.anchors:
            decision = fits
        elif node.op_type in policy.follow:
            acts = [i for i in float_ins if i not in index.inits]
            if acts:
                decision = fits and all(home.get(i) == index.HALF for i in acts)
            else:
                decision = fits and any(i in anchored for i in inits)
        if (policy.everything or node.op_type in policy.anchors) and not fits and node.name not in protected:
            report.kept_fp32_unrepresentable.append(node.name)
        low[node.name] = decision
        if float_outs or float_ins:
            (report.low_nodes if decision else report.fp32_nodes)[node.op_type] += 1
        for out in float_outs:
            home[out] = index.HALF if decision else index.FLOAT
        if node.op_type == "Cast" and not float_ins and float_outs:
            home[node.output[0]] = index.HALF if decision else index.FLOAT
    index.home = home
    index.anchored = anchored
    return low


def _weights_behind(index: _Graph, node, movement) -> set[str]:
    """Initializers a GEMM reads directly or through movement ops (a transposed tied embedding)."""
    found, stack = set(), [i for i in node.input if index.is_float(i)]
    while stack:
        name = stack.pop()
        if name in index.inits:
            if index.fits(name):
                found.add(name)
            continue
        producer = index.producer.get(name)
        if producer is not None and producer.op_type in movement and producer.op_type not in ("Gather",):
            acts = [i for i in producer.input if index.is_float(i) and i not in index.inits]
            if not acts:
                stack += [i for i in producer.input if index.is_float(i)]
    return found


def _initializer_types(index: _Graph, low: dict, report: PassReport) -> dict[str, int]:
    home = dict(index.home)
    for name, init in index.inits.items():
        if init.data_type != index.FLOAT:
            continue
        users = [n for n in index.consumers[name] if n.op_type not in CAST_ANY_INPUT]
        all_low = bool(users) and all(low[n.name] for n in users)
        if index.fits(name) and (name in index.anchored or all_low):
            home[name] = index.HALF
            report.initializers_low += 1
        else:
            home[name] = index.FLOAT
            report.initializers_fp32 += 1
    for value in index.g.input:
        home[value.name] = value.type.tensor_type.elem_type
    return home


def _rewrite(model, index: _Graph, low: dict, home: dict, report: PassReport) -> None:
    from onnx import helper, numpy_helper

    graph = model.graph
    outputs = {v.name for v in graph.output}
    # Graph outputs produced in fp16 get an internal name and a final Cast back to fp32.
    renamed = {}
    for name in outputs:
        if home.get(name) == index.HALF:
            renamed[name] = f"{name}__fp16"
            home[renamed[name]] = index.HALF
    casts, new_nodes = {}, []

    def convert(tensor: str, to: int) -> str:
        if home.get(tensor, to) == to:
            return tensor
        key = (tensor, to)
        if key not in casts:
            suffix = "fp16" if to == index.HALF else "fp32"
            out = f"{tensor}__to_{suffix}"
            new_nodes.append(helper.make_node("Cast", [tensor], [out], name=f"Cast_{out}", to=to))
            casts[key] = out
            report.casts_inserted += 1
        return casts[key]

    for node in list(graph.node):
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = renamed.get(name, name)
        if node.op_type == "Cast":
            attr = next(a for a in node.attribute if a.name == "to")
            if attr.i == index.FLOAT and low[node.name]:
                attr.i = index.HALF
        elif node.op_type not in ("Shape", "Size"):
            target = index.HALF if low[node.name] else index.FLOAT
            for i, name in enumerate(node.input):
                if index.is_float(name) or (name.endswith("__fp16") and name in home):
                    node.input[i] = convert(name, target)
        new_nodes.append(node)
    for original, internal in renamed.items():
        new_nodes.append(helper.make_node("Cast", [internal], [original], name=f"Cast_{original}_out", to=index.FLOAT))
        report.casts_inserted += 1
    del graph.node[:]
    graph.node.extend(new_nodes)
    for i, init in enumerate(graph.initializer):
        if home.get(init.name) == index.HALF and init.data_type == index.FLOAT:
            array = numpy_helper.to_array(init).astype(np.float16)
            graph.initializer[i].CopyFrom(numpy_helper.from_array(array, init.name))


def _rewrite_emulated(model, index: _Graph, low: dict, home: dict) -> None:
    from onnx import helper, numpy_helper

    graph = model.graph
    rounded, new_nodes = {}, []

    def round_pair(source: str, out: str) -> None:
        half = f"{out}__half"
        new_nodes.append(helper.make_node("Cast", [source], [half], name=f"Cast_{half}", to=index.HALF))
        new_nodes.append(helper.make_node("Cast", [half], [out], name=f"Cast_{out}__back", to=index.FLOAT))

    def rounded_input(tensor: str) -> str:
        if home.get(tensor) == index.HALF:  # a low node's output or a low initializer: rounded already
            return tensor
        if tensor not in rounded:
            rounded[tensor] = f"{tensor}__rounded"
            round_pair(tensor, rounded[tensor])
        return rounded[tensor]

    for node in list(graph.node):
        if not low[node.name] or node.op_type in ("Shape", "Size"):
            new_nodes.append(node)
            continue
        if node.op_type != "Cast":
            for i, name in enumerate(node.input):
                if index.is_float(name):
                    node.input[i] = rounded_input(name)
        outs = [(i, o) for i, o in enumerate(node.output) if index.is_float(o) or node.op_type == "Cast"]
        for i, out in outs:
            node.output[i] = f"{out}__exact"
        new_nodes.append(node)
        for _, out in outs:
            round_pair(f"{out}__exact", out)
    del graph.node[:]
    graph.node.extend(new_nodes)
    for i, init in enumerate(graph.initializer):
        if home.get(init.name) == index.HALF and init.data_type == index.FLOAT:
            array = numpy_helper.to_array(init).astype(np.float16).astype(np.float32)
            graph.initializer[i].CopyFrom(numpy_helper.from_array(array, init.name))

"""Tiny ONNX graphs with the structures the precision pass must recognise, written by hand so
the fast tier needs neither torch nor a real export. Shapes follow a Llama block: RMSNorm,
rotary embedding, GEMMs, masked softmax."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
HIDDEN = 16


def _model(nodes, inputs, outputs, inits):
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def rotary_inputs_and_nodes(theta: float = 100000.0, head: int = 64):
    """positions (B,S) int64 -> angle = float(pos) * inv_freq -> cos, sin (B,S,HEAD)."""
    inv_freq = (1.0 / theta ** (np.arange(0, head, 2, dtype=np.float32) / head)).astype(np.float32)
    nodes = [
        helper.make_node("Unsqueeze", ["position_ids", "axis_last"], ["pos3"]),
        helper.make_node("Cast", ["pos3"], ["pos_f"], to=F),
        helper.make_node("Mul", ["pos_f", "inv_freq"], ["angle_half"]),
        helper.make_node("Concat", ["angle_half", "angle_half"], ["angle"], axis=-1),
        helper.make_node("Cos", ["angle"], ["cos"]),
        helper.make_node("Sin", ["angle"], ["sin"]),
    ]
    return nodes, {"inv_freq": inv_freq, "axis_last": np.array([2], np.int64)}


def rotary_graph(head: int = 64):
    """q (B,S,head) rotated by its positions: q*cos + rotate_half(q)*sin, as HF Llama computes it
    (SmolLM2: head 64, rope theta 100000)."""
    nodes, inits = rotary_inputs_and_nodes(head=head)
    half = head // 2
    nodes += [
        helper.make_node("Slice", ["q", "zero", "half", "axis_last"], ["q1"]),
        helper.make_node("Slice", ["q", "half", "end", "axis_last"], ["q2"]),
        helper.make_node("Neg", ["q2"], ["nq2"]),
        helper.make_node("Concat", ["nq2", "q1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["q", "cos"], ["qc"]),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["qc", "rs"], ["q_rot"]),
    ]
    inits |= {"zero": np.array([0], np.int64), "half": np.array([half], np.int64), "end": np.array([head], np.int64)}
    inputs = [helper.make_tensor_value_info("q", F, ["B", "S", head]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["B", "S"])]
    return _model(nodes, inputs, [helper.make_tensor_value_info("q_rot", F, ["B", "S", head])], inits)


def block_graph(seed: int = 0, mask_min: float = float(np.finfo(np.float32).min)):
    """x (B,S,H) -> RMSNorm -> q/k GEMMs -> masked softmax(q k^T) -> GEMM -> residual add -> y."""
    rng = np.random.default_rng(seed)
    inits = {
        "two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32), "axes": np.array([-1], np.int64),
        "norm_w": rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32),
        "wq": rng.normal(0, 0.2, (HIDDEN, HIDDEN)).astype(np.float32),
        "wk": rng.normal(0, 0.2, (HIDDEN, HIDDEN)).astype(np.float32),
        "wo": rng.normal(0, 0.2, (HIDDEN, HIDDEN)).astype(np.float32),
        "bias": rng.normal(0, 0.1, HIDDEN).astype(np.float32),
        "zero_f": np.array(0.0, np.float32), "mask_min": np.array(mask_min, np.float32),
        "perm_axis": np.array([1], np.int64),
    }
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]),
        helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
        helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["inv_rms"]),
        helper.make_node("Mul", ["x", "inv_rms"], ["xn"]),
        helper.make_node("Mul", ["norm_w", "xn"], ["h"]),
        helper.make_node("MatMul", ["h", "wq"], ["q"]),
        helper.make_node("MatMul", ["h", "wk"], ["k"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_b"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["mask_b", "perm_axis"], ["mask_b3"]),
        helper.make_node("Where", ["mask_b3", "zero_f", "mask_min"], ["mask_add"]),
        helper.make_node("Add", ["scores", "mask_add"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "h"], ["ctx"]),
        helper.make_node("MatMul", ["ctx", "wo"], ["o"]),
        helper.make_node("Add", ["o", "bias"], ["ob"]),
        helper.make_node("Add", ["x", "ob"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", F, ["B", "S", HIDDEN]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"])]
    return _model(nodes, inputs, [helper.make_tensor_value_info("y", F, ["B", "S", HIDDEN])], inits)

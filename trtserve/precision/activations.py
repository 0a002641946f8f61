"""Which blocked GEMMs ONNX Runtime runs on int8 activations: plans by structure, fastest first; the
build measures them in order and keeps the first that meets the fidelity target.

Int8 activations (MatMulNBits accuracy level 4: each block of 32 input values quantized to int8, as
llama.cpp does) about halve a 4-bit GEMM's time. Inputs that come out of a normalization are the
best-behaved ones; the FFN's down projection and attention's output projection read products with
outliers. The LM head is the largest GEMM, and an 8-bit weight has no fast kernel for fp32 activations
in ONNX Runtime 1.32 (121 ms against 1.8 ms per SmolLM2 decode step, measured), so a plan that gives
the head fp32 activations keeps its weight in fp32 in the graph instead of 8-bit.

In a decoder the 8-bit GEMMs a plan does not round to int8 run on int8 activations with their rounding residual
(engine_builder/activation_residual.py): about 16-bit activations on the fast kernel, so they keep 8-bit
weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtserve.graph_index import producers as graph_producers
from trtserve.precision.policy import MOVEMENT_OPS


@dataclass(frozen=True)
class Plan:
    label: str
    int8: frozenset  # MatMul names ("*": every blocked GEMM)
    fp32_weights: frozenset = frozenset()  # GEMMs whose weights stay fp32 in the portable graph
    residual: frozenset = frozenset()  # GEMMs on int8 activations and their residual ("*": all not in int8)

    @property
    def fast(self) -> frozenset:
        """The GEMMs whose 8-bit weights stay 8-bit: those on int8 activations and those given the residual (an
        8-bit weight outside them has no fast kernel and is kept fp32); 4-bit weights stay 4-bit either way."""
        return frozenset("*") if "*" in self.residual else self.int8 | self.residual


def lm_head(model) -> str | None:
    """The MatMul whose product is the graph's first output through layout ops only (a decoder's logits)."""
    producers = graph_producers(model.graph)
    node = producers.get(model.graph.output[0].name)
    while node is not None and node.op_type in MOVEMENT_OPS | {"Cast"}:
        node = producers.get(node.input[0])
    return node.name if node is not None and node.op_type == "MatMul" else None


def normalized_gemms(model) -> frozenset:
    """MatMuls whose input is a normalization's output (RMSNorm chains, LayerNormalization)."""
    from trtserve.precision.passes import find_patterns

    norm_nodes = {n for chain in find_patterns(model, ("rmsnorm",))["rmsnorm"] for n in chain}
    norm_nodes |= {n.name for n in model.graph.node
                   if n.op_type in ("LayerNormalization", "SimplifiedLayerNormalization")}
    producers = graph_producers(model.graph)
    return frozenset(n.name for n in model.graph.node if n.op_type == "MatMul"
                     and getattr(producers.get(n.input[0]), "name", None) in norm_nodes)


def plans(model) -> list[Plan]:
    """Decoders (a graph with an LM head): the 8-bit GEMMs outside a plan's int8 set take the rounding residual
    (the 4-bit ones keep fp32 activations, as fast or faster; engine_builder/activation_residual.py), so an
    8-bit weight no longer needs fp32 weights to be fast enough. Encoders compute many rows at once, where the
    residual's second set of rows costs more than fp32 weights: theirs keep fp32."""
    head = lm_head(model)
    every = frozenset("*")
    if head is None:
        return [Plan("every quantized GEMM", every), Plan("GEMMs reading a normalization", normalized_gemms(model)),
                Plan("none", frozenset())]
    heads = frozenset({head})
    return [Plan("every quantized GEMM", every),
            Plan("GEMMs reading a normalization, and the LM head; other 8-bit GEMMs with their rounding residual",
                 normalized_gemms(model) | heads, residual=every),
            Plan("the LM head; other 8-bit GEMMs with their rounding residual", heads, residual=every),
            Plan("8-bit GEMMs only, with their rounding residual", frozenset(), residual=every),
            Plan("none", frozenset(), fp32_weights=heads)]

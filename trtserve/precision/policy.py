"""Precision policies as data: which ops run in fp16, which stay fp32, which patterns are protected.

A policy is applied to an ONNX graph by `passes.apply_policy`; the result is one mixed-precision
file that TensorRT (strongly typed) and ONNX Runtime both obey.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Ops that never change numbers (layout and selection): they run in whatever precision feeds them.
MOVEMENT_OPS = frozenset({
    "Reshape", "Transpose", "Slice", "Concat", "Split", "Squeeze", "Unsqueeze", "Gather", "GatherND",
    "GatherElements", "Expand", "Identity", "Flatten", "Tile", "Pad",
})
# Elementwise arithmetic that is safe in fp16 when both sides already are fp16.
ELEMENTWISE_OPS = frozenset({
    "Add", "Sub", "Mul", "Neg", "Sigmoid", "Gelu", "Relu", "Tanh", "Where", "Clip", "Max", "Min", "Abs",
})
# Overflow- or rounding-prone ops that hybrid keeps in fp32.
FP32_OPS = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization",
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare",
    "ReduceLogSumExp", "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Div", "Erf", "Cos", "Sin", "CumSum",
})
GEMM_OPS = frozenset({"MatMul", "Gemm", "Einsum"})
# Structural patterns that hybrid keeps in fp32 as whole chains (see passes.find_patterns).
PATTERNS = ("rmsnorm", "rotary", "attention_mask")


@dataclass(frozen=True)
class Policy:
    name: str
    low: str = "float16"  # the reduced type: float16 (bf16 later)
    anchors: frozenset = frozenset()  # ops that run in the low type; "*" means every float op
    fp32_ops: frozenset = frozenset()  # ops that stay fp32 whatever feeds them
    fp32_patterns: tuple = ()  # structural patterns kept fp32 as whole chains
    follow: frozenset = field(default_factory=lambda: MOVEMENT_OPS | ELEMENTWISE_OPS)
    fp32_nodes: frozenset = frozenset()  # node names kept fp32 explicitly (auto policy)
    low_embeddings: bool = False  # embedding tables (Gather on an initializer) stored and read low
    weights: str = "float"  # "gguf": the checkpoint's own GGUF blocks; "int8"/"int4": blocks quantized here

    @property
    def everything(self) -> bool:
        return "*" in self.anchors

    def describe(self) -> dict:
        return {
            "policy": self.name,
            "low_precision_type": self.low if self.anchors else None,
            "weights": self.weights,
            "fp16_anchor_ops": sorted(self.anchors),
            "fp32_ops": sorted(self.fp32_ops),
            "fp32_patterns": list(self.fp32_patterns),
            "follow_ops": sorted(self.follow) if self.anchors else [],
            "fp32_nodes": sorted(self.fp32_nodes),
            "low_embeddings": self.low_embeddings or self.everything,
        }


POLICIES = {
    "fp32": Policy("fp32"),
    "fp16": Policy("fp16", anchors=frozenset({"*"})),
    "hybrid": Policy("hybrid", anchors=GEMM_OPS, fp32_ops=FP32_OPS, fp32_patterns=PATTERNS, low_embeddings=True),
    # fp16 plus the node set chosen by precision.search for one model (recorded in the manifest)
    "auto": Policy("auto", anchors=frozenset({"*"})),
    # a GGUF checkpoint's Q4_1/Q8_0 blocks carried into the graph as they are (precision.gguf_policy)
    "gguf": Policy("gguf", weights="gguf"),
    # GEMM and embedding weights quantized in blocks by ONNX Runtime's quantizer, each weight's format chosen by
    # measured sensitivity (precision.sensitivity, precision.quant_policy): int8, or int4 with int8 where needed
    "int8": Policy("int8", weights="int8"),
    "int4": Policy("int4", weights="int4"),
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown precision policy {name!r}; available: {', '.join(POLICIES)}") from None


def policy_from_manifest(entry) -> Policy:
    """The policy an engine was built with (explicit fp32 node sets included), from its manifest's
    `precision` section (engine_dir.manifest.Precision)."""
    base = get_policy(entry.policy)
    nodes = frozenset(entry.fp32_nodes)
    return base if nodes == base.fp32_nodes else Policy(**{**base.__dict__, "fp32_nodes": nodes})

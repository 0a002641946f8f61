"""Phi-3 and Phi-4-mini: query, key and value in one fused projection, gate and up in another; a sliding
window on every layer where config.sliding_window is set; partial rotary; `longrope` scaling, which switches
from the short to the long factors inside the graph once a sequence passes original_max_position_embeddings,
as transformers does (the in-place decode graph cannot express the switch: such engines decode from the
portable graph)."""

from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.families import Family, every_layer

FAMILY = Family(name="phi3", model_types=("phi3",), kind=ModelKind.DECODER, fused=("qkv", "gate_up"),
                windows=every_layer, rope_types=("default", "longrope"))

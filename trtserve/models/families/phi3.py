"""Phi-3 and Phi-4-mini: query, key and value in one fused projection, gate and up in another; a sliding
window on every layer where config.sliding_window is set; partial rotary; `longrope` scaling (short factors
up to original_max_position_embeddings, which then bounds an engine's length)."""

from trtserve.models.families import Family, every_layer

FAMILY = Family(name="phi3", model_types=("phi3",), kind="decoder", fused=("qkv", "gate_up"), windows=every_layer,
                rope_types=("default", "longrope"))

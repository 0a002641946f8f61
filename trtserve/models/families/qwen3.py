"""Qwen3: an RMS norm on each head's query and key (before the rotary embedding), no biases; windows as
Qwen2's."""

from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.families import Family, from_max_window_layers

FAMILY = Family(name="qwen3", model_types=("qwen3",), kind=ModelKind.DECODER, qk_norm=True,
                windows=from_max_window_layers, masks_by_layer_type=True,
                rope_types=("default", "linear", "dynamic", "yarn"))

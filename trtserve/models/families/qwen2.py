"""Qwen2 and Qwen2.5: Llama's layout with biases on the query, key and value projections; a sliding window
on the layers from max_window_layers on where use_sliding_window is set."""

from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.families import Family, from_max_window_layers

FAMILY = Family(name="qwen2", model_types=("qwen2",), kind=ModelKind.DECODER, biases="qkv",
                windows=from_max_window_layers, masks_by_layer_type=True,
                rope_types=("default", "linear", "dynamic", "yarn"))

"""Mistral: Llama's layout with one sliding window on every layer (config.sliding_window; null: none)."""

from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.families import Family, every_layer

FAMILY = Family(name="mistral", model_types=("mistral",), kind=ModelKind.DECODER, windows=every_layer)

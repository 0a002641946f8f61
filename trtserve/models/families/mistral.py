"""Mistral: Llama's layout with one sliding window on every layer (config.sliding_window; null: none)."""

from trtserve.models.families import Family, every_layer

FAMILY = Family(name="mistral", model_types=("mistral",), kind="decoder", windows=every_layer)

"""Gemma 3 (text): Gemma 2's norms, scaled embeddings and gelu-tanh, with q/k RMS norms instead of attention
soft-capping; sliding layers use a local rotary base (rope_local_base_freq), full layers the global one with
its own scaling; the layer pattern comes from layer_types (or sliding_window_pattern)."""

from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.families import Family, layer_windows
from trtserve.models.families.gemma2 import softcaps


def _windows(config: dict) -> tuple[int | None, ...]:
    return layer_windows(config, pattern=int(config.get("sliding_window_pattern") or 6))


FAMILY = Family(name="gemma3_text", model_types=("gemma3_text",), kind=ModelKind.DECODER, norm="rms(1+w)",
                norms_per_layer=4, activation="gelu_tanh", qk_norm=True, embedding_scale=True, windows=_windows,
                softcaps=softcaps, masks_by_layer_type=True, rope_types=("default", "linear"))

"""Gemma 2: embeddings scaled by sqrt(hidden), (1 + w) RMS norms before and after each block, gelu-tanh,
attention scores and final logits soft-capped (tanh(x / cap) * cap), a sliding window on alternate layers,
scores scaled by query_pre_attn_scalar ** -0.5."""

from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.families import Family, layer_windows


def _windows(config: dict) -> tuple[int | None, ...]:
    return layer_windows(config, pattern=2)


def softcaps(config: dict) -> tuple[float | None, float | None]:
    attn, final = config.get("attn_logit_softcapping"), config.get("final_logit_softcapping")
    return (float(attn) if attn else None), (float(final) if final else None)


FAMILY = Family(name="gemma2", model_types=("gemma2",), kind=ModelKind.DECODER, norm="rms(1+w)", norms_per_layer=4,
                activation="gelu_tanh", embedding_scale=True, windows=_windows, softcaps=softcaps,
                masks_by_layer_type=True)

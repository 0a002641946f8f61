"""What differs between the checkpoint families trtserve serves, declared in one small module per family.

Each module defines `FAMILY`, a `Family`: the model types it accepts, whether it is an encoder or a KV-cache
decoder, and the structure the exporter, the precision passes and the runtime meet in its graph (norm form,
biases, soft-caps, sliding windows, rotary variants, embedding scale, activation). The exporter reads the
windows (which mask each layer gets), the manifest records them for the decode graph, and `check` refuses
a configuration the export would get wrong. Adding a family is one module here and one test.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from trtserve.engine_dir.kinds import ModelKind
from trtserve.errors import ModelSourceError


def _no_windows(config: dict) -> tuple[int | None, ...]:
    return (None,) * int(config["num_hidden_layers"])


def _no_caps(config: dict) -> tuple[float | None, float | None]:
    return None, None


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    kind: ModelKind  # ENCODER or DECODER (models.family.detect makes an encoder with a classification head a SCORER)
    norm: str = "rms"  # "rms": x / rms(x) * w; "rms(1+w)": x / rms(x) * (1 + w); "layer": LayerNorm
    norms_per_layer: int = 2  # before attention and feed-forward; Gemma also norms each block's output (4)
    biases: str = "none"  # which projections carry biases: "none", "qkv", "all"
    activation: str = "silu"  # the feed-forward's gate activation
    qk_norm: bool = False  # an RMS norm on each head's query and key before the rotary embedding
    fused: tuple[str, ...] = ()  # projections stored fused: "qkv", "gate_up"
    embedding_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    rope_types: tuple[str, ...] = ("default",)  # rotary variants accepted (rope_parameters / rope_scaling)
    # per layer: the sliding window (keys q - w < k <= q) or None for full attention
    windows: Callable[[dict], tuple[int | None, ...]] = _no_windows
    # attention-score and final-logit soft-caps: tanh(x / cap) * cap
    softcaps: Callable[[dict], tuple[float | None, float | None]] = _no_caps
    # True where the model takes a {layer type: mask} dict (a model with sliding and full layers)
    masks_by_layer_type: bool = False
    # RoBERTa counts positions from padding_idx + 1: that many rows of the position table are never a token's
    positions_after_padding: bool = False

    def check(self, config: dict) -> None:
        """Refuse what the export would get wrong, naming the field."""
        for kind in rope_types(config):
            if kind not in self.rope_types:
                raise ModelSourceError(
                    f"{config.get('model_type')}: rope type {kind!r} is not supported "
                    f"(supported for {self.name}: {', '.join(self.rope_types)})")
        if config.get("use_bidirectional_attention"):
            raise ModelSourceError(f"{config.get('model_type')}: use_bidirectional_attention is not supported")


def rope_types(config: dict) -> list[str]:
    """The rotary variants a config.json names: rope_scaling or rope_parameters, flat or per layer type."""
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if not isinstance(value, dict):
            continue
        nested = [v for v in value.values() if isinstance(v, dict)]
        for entry in nested or [value]:
            kind = entry.get("rope_type") or entry.get("type") or "default"
            if kind not in found:
                found.append(kind)
    return found or ["default"]


def layer_windows(config: dict, pattern: int = 0) -> tuple[int | None, ...]:
    """Windows from `layer_types` (sliding_attention layers get config.sliding_window); a config without
    layer_types gets transformers' default: every `pattern`-th layer full, the others sliding (0: all full)."""
    layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    types = config.get("layer_types") or [
        "sliding_attention" if pattern and (i + 1) % pattern else "full_attention" for i in range(layers)]
    return tuple(int(window) if window and t == "sliding_attention" else None for t in types[:layers])


def from_max_window_layers(config: dict) -> tuple[int | None, ...]:
    """Qwen's windows: only where use_sliding_window is set, on the layers from max_window_layers on."""
    if not config.get("use_sliding_window"):
        return (None,) * int(config["num_hidden_layers"])
    if not config.get("layer_types"):
        start = int(config.get("max_window_layers", 28))  # transformers' default
        config = dict(config, layer_types=["sliding_attention" if i >= start else "full_attention"
                                           for i in range(int(config["num_hidden_layers"]))])
    return layer_windows(config)


def every_layer(config: dict) -> tuple[int | None, ...]:
    """One window on every layer (config.sliding_window; null: none)."""
    window = config.get("sliding_window")
    return (int(window) if window else None,) * int(config["num_hidden_layers"])


def _load() -> dict[str, Family]:
    found = {}
    for module in pkgutil.iter_modules(__path__):
        family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
        for model_type in family.model_types:
            found[model_type] = family
    return found


BY_MODEL_TYPE: dict[str, Family] = _load()


def by_name(name: str) -> Family:
    return next(f for f in BY_MODEL_TYPE.values() if f.name == name)

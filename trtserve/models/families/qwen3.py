"""Qwen3: an RMS norm on each head's query and key (before the rotary embedding), no biases."""

from trtserve.models.families import Family, layer_windows


def _windows(config: dict) -> tuple[int | None, ...]:
    """A window only where use_sliding_window is set: on the layers from max_window_layers on."""
    if not config.get("use_sliding_window"):
        return (None,) * int(config["num_hidden_layers"])
    if not config.get("layer_types"):
        start = int(config.get("max_window_layers", 0))
        config = dict(config, layer_types=["sliding_attention" if i >= start else "full_attention"
                                           for i in range(int(config["num_hidden_layers"]))])
    return layer_windows(config)


FAMILY = Family(name="qwen3", model_types=("qwen3",), kind="decoder", qk_norm=True, windows=_windows,
                masks_by_layer_type=True, rope_types=("default", "linear", "dynamic", "yarn"))

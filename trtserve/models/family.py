"""Detect the model family from config.json, without importing transformers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trtserve.errors import ModelSourceError

# model_type -> (family, kind). Kind decides the export graph: encoder or KV-cache decoder.
SUPPORTED = {
    "bert": ("bert", "encoder"),
    "llama": ("llama", "decoder"),
}


@dataclass(frozen=True)
class ModelInfo:
    family: str  # "bert" | "llama"
    kind: str  # "encoder" | "decoder"
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelSourceError(
            f"{model_dir} has no config.json: give a Hugging Face checkpoint directory "
            "(config.json + model.safetensors + tokenizer) or a bundled model name"
        )
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{path} is not valid JSON ({exc}); restore the file from the checkpoint") from None


def detect(config: dict) -> ModelInfo:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        supported = ", ".join(sorted(SUPPORTED))
        raise ModelSourceError(
            f"unsupported architecture model_type={model_type!r} "
            f"(architectures={config.get('architectures')}); supported model types: {supported}"
        )
    family, kind = SUPPORTED[model_type]
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return ModelInfo(
        family=family,
        kind=kind,
        model_type=model_type,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab_size=int(config["vocab_size"]),
        max_positions=int(config["max_position_embeddings"]),
    )

"""Detect the model family from config.json, without importing transformers (the families: models/families/)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trtserve.engine_dir.kinds import ModelKind
from trtserve.errors import ModelSourceError
from trtserve.models.families import BY_MODEL_TYPE

SUPPORTED = tuple(sorted(BY_MODEL_TYPE))  # the model types trtserve accepts


@dataclass(frozen=True)
class ModelInfo:
    family: str  # a module of models/families
    kind: ModelKind  # DECODER, ENCODER or SCORER (an encoder with a sequence-classification head: a cross-encoder)
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    num_labels: int | None = None  # cross-encoders (ModelKind.SCORER): the classification head's outputs
    sliding_windows: tuple[int | None, ...] | None = None  # per layer (None: full attention); None: no window
    attn_softcap: float | None = None
    final_softcap: float | None = None


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
    family = BY_MODEL_TYPE[model_type]
    family.check(config)
    kind, labels = family.kind, None
    if kind == ModelKind.ENCODER and any(str(a).endswith("ForSequenceClassification")
                                         for a in config.get("architectures") or ()):
        kind = ModelKind.SCORER  # a cross-encoder: a pair in, its classification head's logits out
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    windows = family.windows(config)
    positions = int(config["max_position_embeddings"])
    if family.positions_after_padding:  # RoBERTa: position ids start at pad_token_id + 1
        positions -= int(config.get("pad_token_id") or 0) + 1
    attn_cap, final_cap = family.softcaps(config)
    return ModelInfo(
        family=family.name,
        kind=kind,
        model_type=model_type,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab_size=int(config["vocab_size"]),
        max_positions=positions,
        num_labels=labels,
        sliding_windows=windows if any(w is not None for w in windows) else None,
        attn_softcap=attn_cap,
        final_softcap=final_cap,
    )

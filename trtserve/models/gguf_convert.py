"""Convert a GGUF checkpoint once into an fp32 safetensors directory, cached by content hash."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

from trtserve.fileio import atomic_dir, sha256_file
from trtserve.progress import say, step

if TYPE_CHECKING:
    from transformers import LlamaConfig


def convert_cached(gguf: Path, cache: Path, name: str) -> Path:
    key = sha256_file(gguf)[:16]
    target = cache / f"{name}-{key}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    say(f"{name}: first use, converting {gguf.name} to fp32 safetensors in {target} (cached afterwards)")
    with step(f"converting {gguf.name}"), atomic_dir(target) as tmp:
        _convert(gguf, tmp)
    return target


def _convert(gguf: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # A GGUF-loaded model refuses save_pretrained; the dequantized weights go into a plain model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = LlamaForCausalLM(cast("LlamaConfig", config))  # a Llama GGUF's
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is not stored separately.
    missing = [key for key in missing if not (config.tie_word_embeddings and key == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion lost weights: missing={missing} unexpected={unexpected}")
    fresh.tie_weights()
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)

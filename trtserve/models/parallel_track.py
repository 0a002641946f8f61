"""Parallel-track (PT) decoder in torch: n tracks that synchronise every D layers.

Each track is a Llama-style stack (RMSNorm, RoPE, SwiGLU, GQA) with 1/n of the attention heads,
KV heads and FFN width, reading and writing a full-width residual stream. All tracks start from
the embedding; after every D layers the tracks are combined and continue from the combined state:

    h = embed(ids)
    for each segment of D layers:  x_i = h; run the segment's layers of track i on x_i
                                   h = h + sum_i (x_i - h)          # one all-reduce of the deltas
    logits = lm_head(norm(h))

Choices where the published description is silent, used alike in training and inference:
- The all-reduce sums each track's *update* to the synchronised state (x_i - h), not the states
  themselves; so the embedding is counted once, and n = 1, D = 1 is exactly a dense Llama model.
  That dense model is the tensor-parallel baseline.
- Pre-norm blocks (x + attn(norm(x)), x + ffn(norm(x))), one final RMSNorm before the LM head,
  embedding and (tied) LM head replicated on every track.
- The vocabulary is a compact subset of the tokenizer's (the ids seen in training, plus one
  unknown id); `vocab` maps compact ids to tokenizer ids, and logits can be scattered back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from trtserve.errors import ModelSourceError

MODEL_TYPE = "trtserve_parallel_track"
WEIGHTS = "model.safetensors"
# The tokenizer files a checkpoint carries (SmolLM2's), copied on into its track-sharded engines.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SEPARATOR = "<|endoftext|>"  # joins the training paragraphs: the trained model's end of sequence


def compact_lookup(vocab, size: int) -> np.ndarray:
    """A table from tokenizer id (0..size-1) to compact id; tokens outside the vocabulary map to 0.

    `vocab` lists the tokenizer id of each compact id, with -1 for the unknown id.
    """
    vocab = np.asarray(vocab, dtype=np.int64)
    table = np.zeros(size, dtype=np.int64)
    known = vocab >= 0
    table[vocab[known]] = np.nonzero(known)[0]
    return table


@dataclass(frozen=True)
class PTConfig:
    vocab_size: int
    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 512
    n_tracks: int = 4
    block_depth: int = 4
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_positions: int = 1024
    unk_id: int = 0  # compact id of tokens outside the vocabulary
    eos_token_id: int | None = None  # tokenizer id of the token that ends a sequence (what training separated with)
    extra: dict = field(default_factory=dict)  # training recipe and results, carried into config.json

    def __post_init__(self):
        n = self.n_tracks
        problems = [f"{name} ({value}) is not divisible by n_tracks ({n})"
                    for name, value in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads),
                                        ("intermediate_size", self.intermediate_size)) if value % n]
        if self.num_layers % self.block_depth:
            problems.append(f"num_layers ({self.num_layers}) is not a multiple of block_depth ({self.block_depth})")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if problems:
            raise ModelSourceError("invalid parallel-track config: " + "; ".join(problems))

    @property
    def segments(self) -> int:
        return self.num_layers // self.block_depth

    def to_json(self) -> dict:
        return {"model_type": MODEL_TYPE, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> PTConfig:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**fields)


def is_parallel_track(path: Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == MODEL_TYPE


def tokenizer_dir() -> Path:
    from trtserve.models.sources import resolve

    return resolve("SmolLM2-135M-Instruct").path


@lru_cache(maxsize=1)
def corpus() -> tuple[list[int], list[int]]:
    """(train, held-out) token streams: Wikipedia paragraphs joined by EOS; the last 10% held out."""
    from tokenizers import Tokenizer

    from trtserve.data.corpus import wiki_paragraphs

    tok = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))
    eos = tok.token_to_id(SEPARATOR)
    paragraphs = wiki_paragraphs()
    cut = len(paragraphs) * 9 // 10

    def stream(items):
        out = []
        for encoding in tok.encode_batch(list(items), add_special_tokens=False):
            out.extend(encoding.ids)
            out.append(eos)
        return out

    return stream(paragraphs[:cut]), stream(paragraphs[cut:])


def to_compact(ids: list[int], vocab):
    """Tokenizer ids -> the model's compact ids (0 for tokens outside its vocabulary)."""
    import torch

    array = np.asarray(ids, dtype=np.int64)
    vocab = np.asarray(vocab.tolist(), dtype=np.int64)
    size = int(max(array.max(initial=0), vocab.max(initial=0))) + 1
    return torch.from_numpy(compact_lookup(vocab, size)[array])

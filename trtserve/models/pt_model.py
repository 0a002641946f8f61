"""The parallel-track decoder in torch (see models/parallel_track.py for the architecture and its
config): the stacked-track layers, the single-process reference model, and its checkpoint files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from trtserve.errors import ModelSourceError
from trtserve.models.parallel_track import MODEL_TYPE, TOKENIZER_FILES, WEIGHTS, PTConfig, is_parallel_track


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.weight, self.eps)


def rope(x, positions, theta: float):
    """Rotary embedding (rotate-half form) of x [B, heads, T, hd] at integer positions [T]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rms(x, weight, eps: float):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x, weight):
    """x [s, B, T, in] times each shard's weight [s, out, in] -> [s, B, T, out]. One shard's weight may be given
    as a plain matrix [out, in] (a track's own graph): then it is one MatMul on a 2-D constant, the form
    the precision passes quantize."""
    return torch.matmul(x, weight.t()) if weight.ndim == 2 else torch.einsum("sbti,soi->sbto", x, weight)


def attention(p: dict, x, heads: int, kv_heads: int, head_dim: int, theta: float, past=None):
    """Grouped-query attention of a stack of s shards (tracks, or tensor-parallel slices).

    p: q_proj [s, heads*hd, d], k_proj/v_proj [s, kv_heads*hd, d], o_proj [s, d, heads*hd] (2-D for s = 1: see
    linear);
    x [s, B, T, d] (already normed); past: (k, v) each [s*B, kv_heads, T_past, hd].
    Returns the output projection [s, B, T, d] (no residual) and the new (k, v).
    """
    s, b, t, _ = x.shape
    start = 0 if past is None else past[0].shape[2]
    positions = torch.arange(start, start + t)

    def project(weight, n):
        return linear(x, weight).reshape(s * b, t, n, head_dim).transpose(1, 2)

    q = rope(project(p["q_proj"], heads), positions, theta)
    k = rope(project(p["k_proj"], kv_heads), positions, theta)
    v = project(p["v_proj"], kv_heads)
    group = heads // kv_heads
    if past is None:  # no cache: plain causal attention (training, a fresh prompt)
        mask, causal = None, t > 1
    else:  # after a cache: query at position p sees keys 0..p (no branch on t, so it exports)
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        mask, causal = torch.arange(k.shape[2])[None, :] <= positions[:, None], False
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=causal, attn_mask=mask)
    out = out.transpose(1, 2).reshape(s, b, t, heads * head_dim)
    return linear(out, p["o_proj"]), (k, v)


def feed_forward(p: dict, x):
    """SwiGLU of a stack of shards: gate/up [s, w, d], down [s, d, w]; x [s, B, T, d] (normed)."""
    return linear(F.silu(linear(x, p["gate_proj"])) * linear(x, p["up_proj"]), p["down_proj"])


class Layer(nn.Module):
    """Layer l of every track, the tracks' weights stacked on a leading axis of size n."""

    def __init__(self, cfg: PTConfig):
        super().__init__()
        n, d, hd = cfg.n_tracks, cfg.hidden_size, cfg.head_dim
        heads, kv, width = cfg.num_heads // n, cfg.num_kv_heads // n, cfg.intermediate_size // n
        shapes = {"attn_norm": (n, d), "q_proj": (n, heads * hd, d), "k_proj": (n, kv * hd, d),
                  "v_proj": (n, kv * hd, d), "o_proj": (n, d, heads * hd), "ffn_norm": (n, d),
                  "gate_proj": (n, width, d), "up_proj": (n, width, d), "down_proj": (n, d, width)}
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))

    def params(self, tracks: slice | None = None) -> dict:
        return {name: p if tracks is None else p[tracks] for name, p in self.named_parameters()}


def block(p: dict, x, cfg: PTConfig, heads: int, kv_heads: int, past=None):
    """One pre-norm layer on each shard's own residual x [s, B, T, d]."""
    a, present = attention(p, _rms(x, p["attn_norm"][:, None, None], cfg.rms_norm_eps), heads, kv_heads,
                           cfg.head_dim, cfg.rope_theta, past)
    x = x + a
    return x + feed_forward(p, _rms(x, p["ffn_norm"][:, None, None], cfg.rms_norm_eps)), present


def run_segment(layers, p_of, h, cfg: PTConfig, tracks: int, segment: int, past=None):
    """Run segment `segment` (D layers) of `tracks` stacked tracks from the synchronised state
    h [B, T, d]; return each track's update to h [s, B, T, d] and the presents of those layers."""
    heads, kv_heads = cfg.num_heads // cfg.n_tracks, cfg.num_kv_heads // cfg.n_tracks
    x = h.unsqueeze(0).expand(tracks, *h.shape)
    presents = {}
    for layer in range(segment * cfg.block_depth, (segment + 1) * cfg.block_depth):
        x, presents[layer] = block(p_of(layers[layer]), x, cfg, heads, kv_heads,
                                   None if past is None else past[layer])
    return x - h, presents


class ParallelTrackModel(nn.Module):
    """The single-process reference: every track in one process, the all-reduce a plain sum."""

    vocab: torch.Tensor  # a buffer: the tokenizer id of each compact id (-1: unknown)

    def __init__(self, cfg: PTConfig, vocab: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("vocab", vocab if vocab is not None else torch.arange(cfg.vocab_size), persistent=True)
        self.syncs = 0  # all-reduces performed (one per segment per forward)
        nn.init.normal_(self.embed.weight, std=0.02)
        for layer in self.layers:
            for name, p in layer.named_parameters():
                if name.endswith("norm"):
                    nn.init.ones_(p)
                else:  # projections into the residual get GPT-2's depth scaling
                    scale = 1 / math.sqrt(2 * cfg.num_layers) if name in ("o_proj", "down_proj") else 1.0
                    nn.init.normal_(p, std=0.02 * scale)

    def head(self, h):
        return F.linear(self.norm(h), self.embed.weight)

    def forward(self, ids, past=None):
        """ids [B, T] (compact ids) -> (logits [B, T, V], presents {layer: (k, v)} for all tracks)."""
        cfg = self.cfg
        h = self.embed(ids)
        presents = {}
        for segment in range(cfg.segments):
            deltas, new = run_segment(self.layers, lambda layer: layer.params(), h, cfg, cfg.n_tracks, segment, past)
            presents.update(new)
            h = h + deltas.sum(0)
            self.syncs += 1
        return self.head(h), presents


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_checkpoint(model: ParallelTrackModel, out: Path, tokenizer_dir: Path) -> None:
    """config.json + model.safetensors + the tokenizer files, like a Hugging Face checkpoint."""
    from safetensors.torch import save_file

    from trtserve.fileio import atomic_dir

    with atomic_dir(Path(out)) as tmp:
        (tmp / "config.json").write_text(json.dumps(model.cfg.to_json(), indent=2) + "\n")
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS))
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                (tmp / name).write_bytes((Path(tokenizer_dir) / name).read_bytes())


def load_checkpoint(path: str | Path) -> ParallelTrackModel:
    from safetensors.torch import load_file

    path = Path(path)
    if not is_parallel_track(path):
        raise ModelSourceError(f"{path} is not a parallel-track checkpoint (config.json model_type {MODEL_TYPE})")
    cfg = PTConfig.from_json(json.loads((path / "config.json").read_text()))
    model = ParallelTrackModel(cfg)
    model.load_state_dict(load_file(str(path / WEIGHTS)))
    return model.eval()

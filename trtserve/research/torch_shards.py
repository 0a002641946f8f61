"""Torch shard specs for runtime/sharded.py's driver, to compare parallel tracks with tensor
parallelism on the same kind of checkpoint (models/parallel_track.py; `benchmarks/decode/bench_tracks.py`):
- `pt`: a parallel-track model; each worker owns n/w of its tracks and their KV cache, runs a
  segment of D layers without talking to anyone, then all-reduces its tracks' summed update:
  L/D all-reduces per forward.
- `tp`: the dense model (n = 1) split Megatron-style; each worker owns 1/w of every layer's heads
  (column-parallel QKV, row-parallel output) and FFN (column-parallel gate/up, row-parallel down)
  and their KV cache; an all-reduce after attention and one after the FFN: 2L per forward.
Worker i runs on GPU i with NCCL where there are GPUs (not run on a GPU yet), else on the CPU with
gloo. Embedding, final norm and LM head are replicated; worker 0 returns the last position's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trtserve.errors import TrtServeError
from trtserve.runtime.sharded import ShardedDecoder, check_track_split


def torch_decoder(checkpoint, world: int, mode: str = "pt", threads: int = 1, timeout: float = 300) -> ShardedDecoder:
    """`world` worker processes holding a torch checkpoint sharded as `mode` ('pt' or 'tp')."""
    return ShardedDecoder(TorchShards(str(checkpoint), mode), world, threads, timeout)


@dataclass(frozen=True)
class TorchShards:
    path: str
    mode: str  # "pt" | "tp"

    @property
    def name(self) -> str:
        return self.mode

    def check(self, world: int) -> None:
        from trtserve.models.pt_model import load_checkpoint

        check_layout(load_checkpoint(Path(self.path)).cfg, self.mode, world)

    def device(self, rank: int) -> str:
        import torch

        return f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"

    def load(self, rank: int, world: int, device: str, threads: int) -> TorchShard:
        return TorchShard(self.path, self.mode, rank, world, device)


def shard_params(model, mode: str, rank: int, world: int) -> list[dict]:
    """Per layer, this worker's stacked weights: its tracks (pt) or its slice of the dense layer (tp)."""
    cfg = model.cfg
    if mode == "pt":
        per = cfg.n_tracks // world
        return [layer.params(slice(rank * per, (rank + 1) * per)) for layer in model.layers]
    hd = cfg.head_dim
    heads, kv, width = cfg.num_heads // world, cfg.num_kv_heads // world, cfg.intermediate_size // world
    q, k, f = slice(rank * heads * hd, (rank + 1) * heads * hd), slice(rank * kv * hd, (rank + 1) * kv * hd), \
        slice(rank * width, (rank + 1) * width)
    out = []
    for layer in model.layers:
        p = layer.params()
        out.append({"attn_norm": p["attn_norm"], "ffn_norm": p["ffn_norm"],
                    "q_proj": p["q_proj"][:, q], "k_proj": p["k_proj"][:, k], "v_proj": p["v_proj"][:, k],
                    "o_proj": p["o_proj"][:, :, q], "gate_proj": p["gate_proj"][:, f],
                    "up_proj": p["up_proj"][:, f], "down_proj": p["down_proj"][:, :, f]})
    return out


def check_layout(cfg, mode: str, world: int) -> None:
    if mode == "pt":
        check_track_split(cfg.n_tracks, world)
    elif mode == "tp":
        if cfg.n_tracks != 1:
            raise TrtServeError("tensor parallelism here splits a dense model (n_tracks = 1); this is a "
                                f"{cfg.n_tracks}-track model: use mode 'pt'")
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(cfg, name) % world:
                raise TrtServeError(f"{name} ({getattr(cfg, name)}) is not divisible by {world} workers")
    else:
        raise TrtServeError(f"unknown sharding mode {mode!r}: use 'pt' or 'tp'")


class TorchShard:
    """One worker's part of the model and its KV cache."""

    def __init__(self, path: str, mode: str, rank: int, world: int, device: str = "cpu"):
        from trtserve.models.pt_model import load_checkpoint

        self.model = load_checkpoint(path).to(device)  # embedding and head replicated; layers sliced below
        self.cfg, self.mode, self.world, self.device = self.model.cfg, mode, world, device
        self.params = shard_params(self.model, mode, rank, world)
        self.past: dict | None = None
        self.syncs = 0

    def _all_reduce(self, tensor):
        import torch.distributed as dist

        if self.world > 1:
            dist.all_reduce(tensor)
        self.syncs += 1
        return tensor

    def forward(self, ids, new: bool):
        import torch

        from trtserve.models.pt_model import _rms, attention, feed_forward, run_segment

        cfg, past = self.cfg, None if new else self.past
        h = self.model.embed(torch.as_tensor(ids, device=self.device))
        presents = {}
        if self.mode == "pt":
            for segment in range(cfg.segments):
                updates, new_presents = run_segment(self.params, lambda p: p, h, cfg, cfg.n_tracks // self.world,
                                                    segment, past)
                presents.update(new_presents)
                h = h + self._all_reduce(updates.sum(0).contiguous())
        else:
            heads, kv = cfg.num_heads // self.world, cfg.num_kv_heads // self.world
            for layer, p in enumerate(self.params):
                a, presents[layer] = attention(p, _rms(h, p["attn_norm"][0], cfg.rms_norm_eps)[None], heads, kv,
                                               cfg.head_dim, cfg.rope_theta, None if past is None else past[layer])
                h = h + self._all_reduce(a[0].contiguous())
                h = h + self._all_reduce(feed_forward(p, _rms(h, p["ffn_norm"][0], cfg.rms_norm_eps)[None])[0]
                                         .contiguous())
        self.past = presents
        return self.model.head(h[:, -1]).cpu().numpy()

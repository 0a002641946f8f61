"""Sharded decoding across worker processes joined by torch.distributed (gloo on CPUs, NCCL on GPUs).

Two layouts of the same kind of checkpoint (models/parallel_track.py):
- `pt`: a parallel-track model; each worker owns n/w of its tracks and their KV cache, runs a
  segment of D layers without talking to anyone, then all-reduces its tracks' summed update:
  L/D all-reduces per forward.
- `tp`: the dense model (n = 1) split Megatron-style; each worker owns 1/w of every layer's heads
  (column-parallel QKV, row-parallel output) and FFN (column-parallel gate/up, row-parallel down)
  and their KV cache; an all-reduce after attention and one after the FFN: 2L per forward.
A checkpoint runs in torch, worker i on GPU i with NCCL where there are GPUs (not run on a GPU
yet), else on the CPU with gloo; a track-sharded engine dir (engine_builder/sharding.py) runs its
per-track segment engines in ONNX Runtime on the CPU, with gloo. Embedding, final norm and LM head
are replicated; worker 0 returns the logits of the last position.
The caller talks to the workers over pipes (the inputs, like any serving driver); only the
all-reduces between workers are counted as synchronisations.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from dataclasses import dataclass

from trtserve.errors import TrtServeError


@dataclass
class Step:
    logits: object  # numpy [B, V] (compact vocabulary), the last position of each row
    syncs: int  # all-reduces each worker made in this forward
    seconds: float  # wall time of the forward as the caller saw it


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def check_track_split(tracks: int, world: int) -> None:
    if tracks % world:
        raise TrtServeError(f"{tracks} tracks cannot be split over {world} workers: use a divisor of {tracks}")


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


class _Shard:
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


class _EngineShard:
    """One worker's tracks of a track-sharded engine dir, run by ONNX Runtime."""

    def __init__(self, path: str, rank: int, world: int, threads: int):
        from trtserve.engine_builder.artifact import open_engine_dir
        from trtserve.runtime.track_engines import TrackEngines

        engine = open_engine_dir(path)
        tracks = engine.manifest["parallel_tracks"]["tracks"]
        per = tracks // world
        self.engines = TrackEngines(engine.path, engine.manifest, range(rank * per, (rank + 1) * per), threads)
        self.world = world

    @property
    def syncs(self) -> int:
        return self.engines.syncs

    def _all_reduce(self, array):
        import torch
        import torch.distributed as dist

        if self.world > 1:
            tensor = torch.from_numpy(array)
            dist.all_reduce(tensor)
            return tensor.numpy()
        return array

    def forward(self, ids, new: bool):
        return self.engines.forward(ids, self._all_reduce, new=new)


def _is_engine_dir(path: str) -> bool:
    from pathlib import Path

    from trtserve.engine_builder.artifact import MANIFEST

    return (Path(path) / MANIFEST).is_file()


def _worker(conn, path: str, mode: str, rank: int, world: int, port: int, threads: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    engines = _is_engine_dir(path)
    # torch weights go to GPU `rank` where there are GPUs (NCCL); track engines run on the CPU (gloo).
    device = f"cuda:{rank % torch.cuda.device_count()}" if not engines and torch.cuda.is_available() else "cpu"
    try:
        if world > 1:
            if device != "cpu":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device != "cpu" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=rank, world_size=world)
        shard = _EngineShard(path, rank, world, threads) if engines else _Shard(path, mode, rank, world, device)
        conn.send(("ready", os.getpid()))
        with torch.no_grad():
            while True:
                message = conn.recv()
                if message is None:
                    break
                command, ids = message
                before = shard.syncs
                logits = shard.forward(ids, new=command == "prefill")
                conn.send(("ok", logits if rank == 0 else None, shard.syncs - before))
    except (EOFError, KeyboardInterrupt):
        pass
    except Exception as exc:  # reported to the caller, who raises it as one clear error
        conn.send(("error", f"worker {rank}: {type(exc).__name__}: {exc}", 0))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


class ShardedDecoder:
    """`world` worker processes holding one checkpoint sharded as `mode` ('pt' or 'tp')."""

    def __init__(self, checkpoint, world: int, mode: str = "pt", threads: int = 1, timeout: float = 300):
        if _is_engine_dir(str(checkpoint)):
            from trtserve.engine_builder.artifact import open_engine_dir

            manifest = open_engine_dir(checkpoint).manifest
            if "parallel_tracks" not in manifest:
                raise TrtServeError(f"{checkpoint} is not a track-sharded engine: build one from a parallel-track "
                                    "checkpoint with `trtserve build-engine CHECKPOINT --out DIR`")
            if mode != "pt":
                raise TrtServeError("a track-sharded engine runs with mode 'pt'")
            check_track_split(manifest["parallel_tracks"]["tracks"], world)
            self.cfg = None
        else:
            from trtserve.models.pt_model import load_checkpoint

            self.cfg = load_checkpoint(checkpoint).cfg
            check_layout(self.cfg, mode, world)
        self.mode, self.world, self.timeout = mode, world, timeout
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, str(checkpoint), mode, rank, world, port, threads),
                               daemon=True, name=f"trtserve-{mode}-{rank}")
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.pids = [self._receive(rank)[1] for rank in range(world)]

    def _receive(self, rank: int):
        if not self.conns[rank].poll(self.timeout):
            self.kill()  # hung or stopped: waiting for a polite exit would only add to the delay
            raise TrtServeError(f"sharded worker {rank} did not answer in {self.timeout:g} s")
        try:
            message = self.conns[rank].recv()
        except (EOFError, OSError):
            code = self.procs[rank].exitcode
            self.close()
            raise TrtServeError(f"sharded worker {rank} exited (exit code {code}) before answering") from None
        if message[0] == "error":
            self.close()
            raise TrtServeError(message[1])
        return message

    def _run(self, command: str, ids) -> Step:
        started = time.perf_counter()
        for conn in self.conns:
            conn.send((command, ids))
        answers = [self._receive(rank) for rank in range(self.world)]
        syncs = {answer[2] for answer in answers}
        assert len(syncs) == 1, f"workers disagree on the synchronisations: {syncs}"
        return Step(answers[0][1], syncs.pop(), time.perf_counter() - started)

    def prefill(self, ids) -> Step:
        """Start new sequences: ids [B, T] compact token ids (rows of equal length)."""
        return self._run("prefill", ids)

    def decode(self, ids) -> Step:
        """One more token per row: ids [B, 1]."""
        return self._run("decode", ids)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""Sharded decoding across worker processes joined by torch.distributed (gloo on CPUs, NCCL on GPUs).

A track-sharded engine dir (engine_builder/sharding.py, built from a parallel-track checkpoint,
models/parallel_track.py) runs here: each worker owns n/w of its tracks and their KV cache, runs
its per-track segment engines in ONNX Runtime for D layers without talking to anyone, then
all-reduces its tracks' summed update: L/D all-reduces per forward. Embedding, final norm and LM
head are replicated; worker 0 returns the logits of the last position.

What a worker holds is a *shard spec* (`EngineShards` here; research/torch_shards.py has the torch
layouts a benchmark compares against), so the driver below is the same for all of them. The caller
talks to the workers over pipes (the inputs, like any serving driver); only the all-reduces between
workers are counted as synchronisations.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from trtserve.errors import TrtServeError
from trtserve.runtime.heartbeat import new_heartbeat, silent_for

# -- the messages between the driver and its ranks (pickled as they are) --------------------------------------


@dataclass(frozen=True)
class Forward:
    """Run the model on ids [B, T]: new sequences (`new`, a prefill) or one more token each (a decode)."""

    ids: object
    new: bool


@dataclass(frozen=True)
class RunSlots:
    """The sequence-slot call (runtime/track_backend.py): drop the caches `drops`, then run `ids` on the caches of
    `keys`; logits of every position where `every`, else of the last."""

    drops: list
    keys: list
    ids: object
    every: bool


@dataclass(frozen=True)
class ReadSlot:
    key: object
    start: int
    stop: int


@dataclass(frozen=True)
class WriteSlot:
    key: object
    rows: dict


@dataclass(frozen=True)
class ResetSlots:
    """A new set of slots: the caches of the one before are gone."""


@dataclass(frozen=True)
class StopRank:
    pass


@dataclass(frozen=True)
class RankReady:
    pid: int


@dataclass(frozen=True)
class RankAnswer:
    value: object  # rank 0's result (every rank's for ReadSlot); None from the others
    syncs: int  # all-reduces the rank made for it


@dataclass(frozen=True)
class RankFailed:
    error: str


SlotMessage = RunSlots | ReadSlot | WriteSlot | ResetSlots


@dataclass
class Step:
    logits: object  # numpy [B, V] (compact vocabulary), the last position of each row
    syncs: int  # all-reduces each worker made in this forward
    seconds: float  # wall time of the forward as the caller saw it


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_track_split(tracks: int, world: int) -> None:
    if tracks % world:
        raise TrtServeError(f"{tracks} tracks cannot be split over {world} workers: use a divisor of {tracks}")


@dataclass(frozen=True)
class EngineShards:
    """Shard spec of a track-sharded engine dir: worker r runs tracks [r n/w, (r+1) n/w) on the CPU."""
    path: str
    name = "pt"

    def check(self, world: int) -> None:
        from trtserve.engine_dir import open_engine_dir

        manifest = open_engine_dir(self.path).manifest
        if manifest.parallel_tracks is None:
            raise TrtServeError(f"{self.path} is not a track-sharded engine: build one from a parallel-track "
                                "checkpoint with `trtserve build-engine CHECKPOINT --out DIR`")
        check_track_split(manifest.parallel_tracks.tracks, world)

    def device(self, rank: int) -> str:
        return "cpu"

    def load(self, rank: int, world: int, device: str, threads: int) -> _EngineShard:
        return _EngineShard(self.path, rank, world, threads)


class _EngineShard:
    """One worker's tracks of a track-sharded engine dir, run by ONNX Runtime."""

    def __init__(self, path: str, rank: int, world: int, threads: int):
        from trtserve.engine_dir import open_engine_dir
        from trtserve.runtime.track_engines import TrackEngines

        engine = open_engine_dir(path)
        assert engine.manifest.parallel_tracks is not None
        tracks = engine.manifest.parallel_tracks.tracks
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

    def answer(self, message: SlotMessage):
        """The sequence-slot operations (runtime/track_backend.py): caches kept per key."""
        if isinstance(message, RunSlots):
            self.engines.drop(message.drops)
            return self.engines.run(message.keys, message.ids, self._all_reduce, message.every)
        if isinstance(message, ReadSlot):
            return self.engines.read(message.key, message.start, message.stop)
        if isinstance(message, WriteSlot):
            return self.engines.write(message.key, message.rows)
        if isinstance(message, ResetSlots):
            return self.engines.caches.clear()
        raise ValueError(f"unknown message {type(message).__name__}")


def _worker(conn, spec, rank: int, world: int, port: int, threads: int, heartbeat=None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if heartbeat is not None:
        from trtserve.runtime.heartbeat import start_beating

        start_beating(heartbeat)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    device = spec.device(rank)
    try:
        if world > 1:
            if device != "cpu":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device != "cpu" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=rank, world_size=world)
        shard = spec.load(rank, world, device, threads)
        conn.send(RankReady(os.getpid()))
        with torch.no_grad():
            while True:
                message = conn.recv()
                if isinstance(message, StopRank):
                    break
                before = shard.syncs
                if isinstance(message, Forward):
                    value = shard.forward(message.ids, new=message.new)
                else:
                    value = shard.answer(message)
                conn.send(RankAnswer(value if rank == 0 or isinstance(message, ReadSlot) else None,
                                     shard.syncs - before))
    except (EOFError, KeyboardInterrupt):
        pass
    except Exception as exc:  # reported to the caller, who raises it as one clear error
        conn.send(RankFailed(f"worker {rank}: {type(exc).__name__}: {exc}"))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


class ShardedDecoder:
    """`world` worker processes each holding its part of `spec` (EngineShards, or an engine dir's path)."""

    def __init__(self, spec, world: int, threads: int = 1, timeout: float = 300, start_timeout: float = 300,
                 heartbeat: float | None = None):
        """`timeout`: seconds each call may take; `start_timeout`: seconds the ranks may take to load (importing
        torch and opening their sessions is not a step and must not count against a step's deadline);
        `heartbeat`: seconds a rank may go without a heartbeat while a call waits on it (stopped or wedged:
        the call fails then, not at its deadline)."""
        if isinstance(spec, (str, Path)):
            spec = EngineShards(str(spec))
        spec.check(world)
        self.spec, self.world, self.timeout, self.heartbeat_timeout = spec, world, timeout, heartbeat
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        self.conns, self.procs, self.heartbeats = [], [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            beats = new_heartbeat(ctx) if heartbeat else None
            proc = ctx.Process(target=_worker, args=(child, spec, rank, world, port, threads, beats),
                               daemon=True, name=f"trtserve-{spec.name}-{rank}")
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
            self.heartbeats.append(beats)
        self.pids = [self._receive(rank, start_timeout).pid for rank in range(world)]

    def _receive(self, rank: int, timeout: float | None = None):
        timeout = self.timeout if timeout is None else timeout
        if not self._wait(rank, timeout):
            self.kill()  # hung or stopped: waiting for a polite exit would only add to the delay
            raise TrtServeError(f"sharded worker {rank} did not answer in {timeout:g} s")
        try:
            message = self.conns[rank].recv()
        except (EOFError, OSError):
            code = self.procs[rank].exitcode
            self.close()
            raise TrtServeError(f"sharded worker {rank} exited (exit code {code}) before answering") from None
        if isinstance(message, RankFailed):
            self.close()
            raise TrtServeError(message.error)
        return message

    def _wait(self, rank: int, timeout: float) -> bool:
        """Whether rank's answer came within `timeout`; False early when any rank's heartbeat is silent."""
        if self.heartbeat_timeout is None:
            return self.conns[rank].poll(timeout)
        deadline = time.monotonic() + timeout
        while not self.conns[rank].poll(min(0.25, max(deadline - time.monotonic(), 0))):
            quiet = max(silent_for(beats) for beats in self.heartbeats)
            if time.monotonic() >= deadline or quiet > self.heartbeat_timeout:
                return False
        return True

    def _run(self, message: Forward) -> Step:
        started = time.perf_counter()
        self._send(message)
        answers = [self._receive(rank) for rank in range(self.world)]
        syncs = {answer.syncs for answer in answers}
        assert len(syncs) == 1, f"workers disagree on the synchronisations: {syncs}"
        return Step(answers[0].value, syncs.pop(), time.perf_counter() - started)

    def call(self, message: SlotMessage) -> list:
        """A sequence-slot operation on every rank; each rank's answer."""
        self._send(message)
        return [self._receive(rank).value for rank in range(self.world)]

    def _send(self, message) -> None:
        try:
            for conn in self.conns:
                conn.send(message)
        except (OSError, ValueError):  # a rank's pipe is gone
            self.kill()
            raise TrtServeError(f"a sharded worker exited (exit codes {[p.exitcode for p in self.procs]})") from None

    def prefill(self, ids) -> Step:
        """Start new sequences: ids [B, T] compact token ids (rows of equal length)."""
        return self._run(Forward(ids, new=True))

    def decode(self, ids) -> Step:
        """One more token per row: ids [B, 1]."""
        return self._run(Forward(ids, new=False))

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(StopRank())
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

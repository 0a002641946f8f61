"""Serving a track-sharded engine across worker processes (`trtserve serve DIR --tracks N`).

The N workers are the sharded decoder's ranks (runtime/sharded.py): each owns its tracks'
engines and KV cache and all-reduces at segment boundaries. Requests share the completions and
chat logic of DecoderService (server/generation.py); sequences run one at a time (batch 1), each
decode step in a thread so the event loop keeps serving; every call into the ranks has a deadline.
The model's compact vocabulary is mapped to and from the tokenizer's ids here; its unknown-token
id is never generated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import numpy as np

from trtserve.errors import TrtServeError
from trtserve.models.parallel_track import compact_lookup
from trtserve.runtime.sampling import Sampler, SamplingError, SamplingParams, finish_reason
from trtserve.runtime.sharded import check_track_split
from trtserve.server.config import ServerConfig
from trtserve.server.errors import Overloaded, Unavailable
from trtserve.server.generation import DecoderService, Job, Submission

log = logging.getLogger("trtserve.server")


def check_tracks_option(engine_dir, manifest, tracks: int | None) -> None:
    """`--tracks N` is for track-sharded engines only, and N must divide their tracks."""
    if tracks is None:
        return
    if manifest.parallel_tracks is None:
        raise TrtServeError(f"--tracks is for track-sharded engines (built from a parallel-track checkpoint); "
                            f"{engine_dir} is not one (its model kind is {manifest.model.kind}): "
                            "leave --tracks out")
    check_track_split(manifest.parallel_tracks.tracks, tracks)


class TrackGenerationService(DecoderService):
    """Sequences one at a time (an asyncio lock) behind a bounded wait (--max-queue, 429 beyond);
    every call into the ranks has the --worker-timeout deadline; ranks that fail or miss it are
    closed and started afresh (with backoff), and /health is 503 until they are back."""

    def __init__(self, cfg: ServerConfig, metrics=None):
        super().__init__(cfg, metrics, verify=True)  # a bad engine is refused here, before any rank starts
        self.tracks = cfg.tracks or self.manifest.parallel_tracks.tracks
        self.max_seq = self.manifest.model.architecture.max_positions
        self.vocab = self.tokenizer.get_vocab_size()
        compact = np.array(json.loads((self.engine.path / "vocab.json").read_text()), dtype=np.int64)
        self.to_tokenizer = compact
        self.to_compact = compact_lookup(compact, self.vocab)
        self.eos = {int(self.to_compact[t]) for t in self.special.eos_ids if self.to_compact[t]}
        self.decoder = None
        self.lock = asyncio.Lock()
        self.busy = False
        self.pending = 0  # sequences admitted and not finished (one runs, the rest wait for the lock)
        self.progress = time.monotonic()  # the ranks' last answer while busy
        self.restarts = 0
        self.last_ok = 0.0
        self._restarting: asyncio.Task | None = None
        log.info("tracks: %d engine tracks over %d worker process(es), %d all-reduce(s) per forward",
                 self.manifest.parallel_tracks.tracks, self.tracks, self.manifest.parallel_tracks.sync.per_forward)

    def _start_decoder(self):
        from trtserve.runtime.sharded import EngineShards, ShardedDecoder
        from trtserve.server.workers import LOAD_TIMEOUT

        return ShardedDecoder(EngineShards(str(self.engine.path)), self.tracks, self.cfg.threads or 1,
                              timeout=self.cfg.worker_timeout, start_timeout=LOAD_TIMEOUT)

    async def start(self) -> None:
        self.decoder = await asyncio.to_thread(self._start_decoder)
        if self.metrics is not None:
            self.metrics.running_seqs.set_function(lambda: int(self.busy))
            self.metrics.waiting_seqs.set_function(lambda: max(self.pending - int(self.busy), 0))
        await self.probe()

    async def stop(self) -> None:
        if self._restarting is not None:
            self._restarting.cancel()
        if self.decoder is not None:
            await asyncio.to_thread(self.decoder.close)

    async def probe(self) -> None:
        job = Job(self.tokenize("Hello"), SamplingParams(max_tokens=1, temperature=0), [])
        if self.alive():
            async for _ in self.stream(job):
                pass
        elif self.decoder is not None and self._restarting is None:  # a rank died while idle
            self._failed("a rank exited")

    def alive(self) -> bool:
        return self.decoder is not None and self._restarting is None and all(p.is_alive() for p in self.decoder.procs)

    def stuck(self) -> bool:
        """Busy, and the ranks have not answered within the deadline."""
        return self.busy and time.monotonic() - self.progress > self.cfg.worker_timeout

    def healthy(self, within: float) -> bool:
        return self.alive() and not self.stuck() and (self.busy or time.monotonic() - self.last_ok < within)

    def workers(self) -> list[dict]:
        """The sharded decoder's ranks."""
        if self.decoder is None:
            return []
        return [{"index": rank, "pid": pid, "device": None, "ready": proc.is_alive() and not self.stuck(),
                 "outstanding": self.pending, "restarts": self.restarts}
                for rank, (pid, proc) in enumerate(zip(self.decoder.pids, self.decoder.procs))]

    def submit(self, jobs: list[Job]) -> Submission:
        if not self.alive():
            raise Unavailable("the track workers are restarting; retry shortly")
        if self.pending + len(jobs) > self.cfg.max_queue + 1:
            raise Overloaded(f"{self.pending} sequences are running or waiting (one at a time, at most "
                             f"{self.cfg.max_queue} waiting, --max-queue); retry shortly")
        return Submission([self.stream(job) for job in jobs])

    async def stream(self, job: Job, worker=None):
        self.pending += 1
        try:
            async with self.lock:  # one sequence at a time
                if not self.alive():
                    raise Unavailable("the track workers are restarting; retry shortly")
                async for piece in self._run(job):
                    yield piece
        finally:
            self.pending -= 1

    async def _run(self, job: Job):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        self.busy, self.progress = True, time.monotonic()
        thread = threading.Thread(target=self._generate, args=(job, loop, events, cancel), daemon=True)
        thread.start()
        try:
            async for piece in self.pieces(job, events.get, 0):
                yield piece
        finally:
            cancel.set()
            # every rank call has the deadline, so the thread ends within it (and a close of the ranks)
            await asyncio.to_thread(thread.join, self.cfg.worker_timeout + 30)
            self.busy = False

    def _failed(self, error: str) -> None:
        """On the event loop: the ranks failed or missed their deadline; start them afresh."""
        if self._restarting is None:
            log.error("track workers failed (%s); restarting them", error)
            self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        from trtserve.server.workers import RESTART_BACKOFF

        old, attempt = self.decoder, 0
        if old is not None:
            await asyncio.to_thread(old.close)
        while True:
            try:
                self.decoder = await asyncio.to_thread(self._start_decoder)
                break
            except Exception as exc:  # noqa: BLE001 - keep trying, as for worker processes
                wait = RESTART_BACKOFF[min(attempt, len(RESTART_BACKOFF) - 1)]
                log.error("track workers failed to start (%s); next try in %g s", exc, wait)
                attempt += 1
                await asyncio.sleep(wait)
        self.restarts += 1
        if self.metrics is not None:
            self.metrics.worker_restarts.inc()
        self._restarting = None
        log.info("track workers restarted: pids %s", self.decoder.pids)

    def _generate(self, job: Job, loop, events: asyncio.Queue, cancel: threading.Event) -> None:
        """The decode loop, on a thread: events go to the request's queue."""
        def emit(**event):
            loop.call_soon_threadsafe(events.put_nowait, {"token": -1, "finish": None, "logprob": None,
                                                          "top_logprobs": None, **event})

        params = job.params
        decoder = self.decoder
        try:
            sampler = Sampler(params, len(self.to_tokenizer))
            step = decoder.prefill(self.to_compact[np.array(job.prompt)][None])
            self.progress = time.monotonic()
            for generated in range(1, params.max_tokens + 1):
                logits = step.logits[0].astype(np.float32)
                logits[0] = -np.inf  # the unknown id is not a token
                token, logprob, top = sampler.choose(logits)
                finish = finish_reason(token, params, self.eos, generated, len(job.prompt) + generated, self.max_seq)
                if finish == "stop":
                    emit(finish="stop", logprob=logprob, top_logprobs=self._map_top(top))
                    break
                emit(token=int(self.to_tokenizer[token]), logprob=logprob, top_logprobs=self._map_top(top),
                     finish=finish)
                if finish or cancel.is_set():
                    break
                step = decoder.decode(np.array([[token]]))
                self.progress = time.monotonic()
            self.last_ok = time.monotonic()
        except SamplingError as exc:  # this sequence cannot go on; the ranks are fine
            emit(error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a rank failed or missed its deadline: the ranks are started afresh
            emit(error="worker_died" if isinstance(exc, TrtServeError) else f"{type(exc).__name__}: {exc}")
            loop.call_soon_threadsafe(self._failed, str(exc))

    def _map_top(self, top):
        return None if top is None else [(int(self.to_tokenizer[t]), lp) for t, lp in top if t]


"""Workers that own a backend each: processes (ProcessWorker: one per GPU, pinned with
CUDA_VISIBLE_DEVICES, or N on the CPU) or, with --workers 0, the server process itself
(InProcessWorker); how a worker runs is its class, what it serves (embedding batches, or the continuous
batcher of a decoder, track-sharded ones included) its options. Batches go to the ready worker with the
least outstanding rows; a supervisor restarts a worker process that dies, and the batches it held
fail with 503 instead of hanging.

Every worker process beats a heartbeat from a thread of its own, busy or idle; one silent for
--heartbeat-timeout (SIGSTOPped, or stuck holding the interpreter) is killed and restarted like one
that died, whatever it was running. Every call into a worker also has a deadline (--worker-timeout):
a worker that beats but does not finish a batch or a step in time is killed too. An in-process worker
cannot be killed: its callers get 503 at the deadline and its generation loop is started afresh."""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from trtserve.runtime.events import Failure
from trtserve.runtime.heartbeat import new_heartbeat, silent_for, start_beating
from trtserve.server.errors import ServingError, Unavailable
from trtserve.server.messages import Embedded, EmbedFailed, EmbedRows, StopWorker, WorkerFailed, WorkerReady

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from trtserve.server.generation_worker import GenerationChannel

log = logging.getLogger("trtserve.server")
LOAD_TIMEOUT = 300.0
RESTART_BACKOFF = (0.5, 1, 2, 5, 10, 30)


class WorkerError(ServingError):
    """The backend raised while running a batch."""


def _worker_main(conn, engine_dir: str, device: int | None, threads: int | None, generation: dict | None,
                 heartbeat=None, ranks: dict | None = None) -> None:
    """Body of a worker process: load the engine, then answer EmbedRows until told to stop (StopWorker), or, for
    decoders (`generation` options given), run the continuous batcher (server/messages.py has every message)."""
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops its workers
    if heartbeat is not None:
        start_beating(heartbeat)
    try:
        text = _load(engine_dir, threads, ranks)
        if generation is not None:  # its sessions are loaded before it reports ready
            from trtserve.server.generation_worker import generation_loop, new_batcher

            batcher = new_batcher(text, **generation)
    except Exception as exc:  # reported to the server, which refuses to start with this message
        conn.send(WorkerFailed(f"{type(exc).__name__}: {exc}"))
        return
    conn.send(WorkerReady(os.getpid(), _processes(text.backend)))
    if generation is not None:
        generation_loop(conn, text, **generation, batcher=batcher)
        text.backend.close()
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server is gone
            break
        if not isinstance(message, EmbedRows):  # StopWorker
            break
        try:
            conn.send(Embedded(text.encode_ids(message.rows)))
        except Exception as exc:
            conn.send(EmbedFailed(f"{type(exc).__name__}: {exc}"))
    text.backend.close()


def _load(engine_dir: str, threads: int | None, ranks: dict | None = None):
    from trtserve.runtime import load_backend
    from trtserve.runtime.text import TextEngine

    # the TensorRT plan where it can run; a track-sharded engine's ranks
    return TextEngine(load_backend(engine_dir, "auto", ranks=ranks, threads=threads))


def _started(pid: int) -> str | None:
    """A process's start time (Linux: /proc/PID/stat, field 22), which a later process with the same pid does
    not share; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _processes(backend) -> list[int]:
    """The pids of a backend's own helper processes (a track engine's ranks), which die with its worker."""
    return list(backend.processes) if backend.abilities.processes else []


class Worker:
    """What every backend owner has, however it runs (ProcessWorker, InProcessWorker): what it serves
    (`generation` options: the continuous batcher; None: batches of embedding rows), its channel, load and
    restarts. Calls run one at a time on its own thread, so one batch is in flight."""

    inline = False  # whether it runs in the server process

    def __init__(self, index: int, engine_dir: str, device: int | None, threads: int | None,
                 generation: dict | None = None, deadline: float = 120.0, heartbeat: float = 10.0,
                 ranks: dict | None = None):
        self.index, self.engine_dir, self.device, self.threads = index, engine_dir, device, threads
        self.ranks = ranks  # a track-sharded engine's rank options: its backend runs processes of its own
        self.generation = generation  # continuous-batching options for decoder engines; None: embeddings
        # decoders: (new prefix-cache queries, hits) as the worker reports them
        self.on_prefix: Callable[[int, int], None] | None = None
        self.deadline = deadline  # seconds one call (or one generation step) may take
        self.heartbeat_timeout = heartbeat  # seconds a worker process may go without a beat
        self.channel: GenerationChannel | None = None  # a decoder worker's
        self.loop: asyncio.AbstractEventLoop | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"trtserve-worker-{index}")
        self.outstanding = 0  # rows sent and not yet answered
        self.ready = False
        self.restarts = 0
        self.last_probe_ok = 0.0
        self.conn: Connection | None = None

    # -- how it runs: each kind's own -----------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        raise NotImplementedError

    def load(self) -> None:
        """Load the engine (and start the generation loop); blocking, on the worker's own thread."""
        raise NotImplementedError

    def call(self, rows: list[list[int]]):
        """Run one batch of embedding rows; blocking, on the worker's own thread."""
        raise NotImplementedError

    def died(self) -> bool:
        raise NotImplementedError

    def silent(self) -> float | None:
        """Seconds since its last heartbeat, when over --heartbeat-timeout (None: beating, or no heartbeat)."""
        return None

    def hung(self, why: str) -> bool:
        """Give up on it (silent, or stalled): what it held fails as WORKER_HUNG; whether it is running again
        already (an in-process loop is replaced at once; a process is killed, and restarted once died())."""
        raise NotImplementedError

    def revive(self) -> bool:
        """After died(): whether it runs again already (an in-process loop); False: restart it with load()."""
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def _backend_pids(self) -> list[int]:
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------------
    def _open_channel(self) -> None:
        from trtserve.server.generation_worker import GenerationChannel

        assert self.loop is not None  # the pool's, set before any worker loads
        self.channel = GenerationChannel(self.conn, self.loop)
        self.channel.on_prefix = self.on_prefix

    @property
    def load_now(self) -> int:
        """Outstanding work: rows for embeddings, open sequences for generation."""
        return len(self.channel.streams) if self.channel is not None else self.outstanding

    def stalled(self) -> bool:
        """A decoder worker that holds sequences and has not answered within its deadline."""
        return self.ready and self.channel is not None and self.channel.stalled(self.deadline)

    def kill_processes(self) -> None:
        """SIGKILL the backend's processes (a dead worker's may be left behind, a hung one's too), each only while
        it is still the process that was reported (its pid may be another's once it has exited)."""
        for pid, started in self._backend_processes():
            if started is not None and _started(pid) != started:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _backend_processes(self) -> list[tuple[int, str | None]]:
        """(pid, start time or None) of each backend process."""
        return [(pid, None) for pid in self._backend_pids()]

    def status(self) -> list[dict]:
        """What /health shows: the worker, or each process of its backend (a track engine's ranks)."""
        pids = self._backend_pids()
        return [{"index": i if pids else self.index, "pid": pid, "device": self.device, "ready": self.ready,
                 "outstanding": self.load_now, "restarts": self.restarts} for i, pid in enumerate(pids or [self.pid])]


class ProcessWorker(Worker):
    """A worker process (spawned, pinned to its GPU): it beats a heartbeat, each call into it has the deadline,
    and one that dies or hangs is killed and loaded afresh."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.proc = None
        self.heartbeat = None  # the process's last beat (shared memory, time.monotonic())
        self.processes: list[int] = []  # its backend's processes, as it reported them when it was ready
        self.started: dict[int, str | None] = {}  # their start times then (Linux), to tell a reused pid

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def load(self) -> None:
        if self.conn is not None:  # the pipe of a process that died
            self.conn.close()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads or a GPU context
        parent, child = ctx.Pipe()
        heartbeat = new_heartbeat(ctx)
        # a worker whose backend starts processes of its own cannot be a daemon (daemons have no children); it is
        # killed at exit like one, whatever stops the server
        proc = ctx.Process(target=_worker_main,
                           args=(child, self.engine_dir, self.device, self.threads, self.generation, heartbeat,
                                 self.ranks),
                           name=f"trtserve-worker-{self.index}", daemon=self.ranks is None)
        proc.start()
        if self.ranks is not None:
            atexit.register(proc.kill)
        child.close()  # so that the worker's death reads as EOF here
        try:
            if not parent.poll(LOAD_TIMEOUT):
                raise RuntimeError(f"worker {self.index} did not load the engine within {LOAD_TIMEOUT:g} s")
            started = parent.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"worker {self.index} exited (code {proc.exitcode}) while loading the engine") from None
        except BaseException:
            proc.kill()
            raise
        if not isinstance(started, WorkerReady):
            proc.join(5)
            raise RuntimeError(f"worker {self.index} could not load the engine: {getattr(started, 'error', started)}")
        self.proc, self.conn, self.heartbeat = proc, parent, heartbeat
        self.processes = started.processes
        self.started = {pid: _started(pid) for pid in self.processes}
        if self.generation is not None:
            self._open_channel()
        self.ready = True

    def call(self, rows: list[list[int]]):
        conn = self.conn
        if not self.ready or conn is None:
            raise Unavailable(f"worker {self.index} is restarting; retry the request")
        try:
            conn.send(EmbedRows(rows))
            if not conn.poll(self.deadline):
                self.kill(f"it did not answer a batch within {self.deadline:g} s (--worker-timeout)")
                raise Unavailable(f"worker {self.index} did not answer within {self.deadline:g} s and is being "
                                  "restarted; retry the request")
            answer = conn.recv()
        except (EOFError, OSError):
            raise Unavailable(f"worker {self.index} stopped while running this request; retry it") from None
        if isinstance(answer, EmbedFailed):
            raise WorkerError(f"the backend failed on this batch: {answer.error}")
        return answer.outputs

    def died(self) -> bool:
        return self.ready and self.proc is not None and not self.proc.is_alive()

    def silent(self) -> float | None:
        if not self.ready or self.heartbeat is None or not self.proc.is_alive():
            return None
        quiet = silent_for(self.heartbeat)
        return quiet if quiet > self.heartbeat_timeout else None

    def hung(self, why: str) -> bool:
        if self.channel is not None:
            self.channel.fail(Failure.WORKER_HUNG)
        self.kill(why)  # died() sees it next
        return False

    def revive(self) -> bool:
        log.error("worker %d (pid %d) died with exit code %s; restarting it", self.index, self.proc.pid,
                  self.proc.exitcode)
        self.kill_processes()  # a worker that died without ending them
        self.processes = []
        return False

    def kill(self, why: str) -> None:
        """SIGKILL (which also ends a SIGSTOPped process) to it and to its backend's processes."""
        if self.proc is not None and self.proc.is_alive():
            log.error("worker %d (pid %d): %s; killing it", self.index, self.proc.pid, why)
            self.proc.kill()
        self.kill_processes()

    def stop(self, timeout: float = 10.0) -> None:
        """Blocking: ask the process to exit, kill it if it does not."""
        self.ready = False
        if self.channel is not None:
            self.channel.stop_worker()
        if self.proc is None:
            return
        assert self.conn is not None  # set with proc
        if self.channel is None:  # a decoder worker's pipe is written by its channel's thread only
            try:
                self.conn.send(StopWorker())
            except (OSError, ValueError):
                pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()

    def _backend_pids(self) -> list[int]:
        return self.processes

    def _backend_processes(self) -> list[tuple[int, str | None]]:
        return [(pid, self.started.get(pid)) for pid in self.processes]


class InProcessWorker(Worker):
    """The server process itself (--workers 0): batches run on the worker's thread, the generation loop on a
    thread of its own. A thread cannot be killed: a stalled loop's sequences fail and a fresh loop takes over;
    calls into it get 503 at the deadline."""

    inline = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text = None
        self.thread: threading.Thread | None = None  # the generation loop

    @property
    def pid(self) -> int | None:
        return os.getpid()

    def load(self) -> None:
        if self.text is None:
            self.text = _load(self.engine_dir, self.threads, self.ranks)
        if self.generation is not None:
            from trtserve.server.generation_worker import new_batcher

            self.start_loop(new_batcher(self.text, **self.generation))
        self.ready = True

    def start_loop(self, batcher=None) -> None:
        """The batcher on a thread of this process, over a local pipe."""
        from trtserve.server.generation_worker import generation_loop

        assert self.generation is not None  # a decoder's
        parent, child = multiprocessing.Pipe()
        self.thread = threading.Thread(target=generation_loop, args=(child, self.text),
                                       kwargs={**self.generation, "batcher": batcher},
                                       name="trtserve-generation", daemon=True)
        self.thread.start()
        self.conn = parent
        self._open_channel()

    def call(self, rows: list[list[int]]):
        return self.text.encode_ids(rows)

    def died(self) -> bool:
        return self.ready and self.thread is not None and not self.thread.is_alive()

    def hung(self, why: str) -> bool:
        log.error("in-process generation loop: %s; starting a new one", why)
        assert self.channel is not None  # the loop's, opened by start_loop
        self.channel.fail(Failure.WORKER_HUNG)
        self.kill_processes()  # a call waiting on them ends, and the new loop starts them afresh
        self.start_loop()
        return True

    def revive(self) -> bool:
        log.error("the in-process generation loop stopped; starting a new one")
        assert self.channel is not None  # the loop's, opened by start_loop
        self.channel.fail(Failure.WORKER_DIED)
        self.start_loop()
        return True

    def stop(self, timeout: float = 10.0) -> None:
        self.ready = False
        if self.channel is not None:
            self.channel.stop_worker()
        elif self.text is not None:
            self.text.backend.close()

    def _backend_pids(self) -> list[int]:
        return _processes(self.text.backend) if self.text is not None else []


class WorkerPool:
    def __init__(self, engine_dir: str, workers: int, devices: list[int | None], threads: int | None, metrics=None,
                 generation: dict | None = None, deadline: float = 120.0, heartbeat: float = 10.0,
                 ranks: dict | None = None):
        kind = InProcessWorker if workers == 0 else ProcessWorker  # how they run; `generation`: what they serve
        self.deadline = deadline
        self.workers: list[Worker] = [kind(i, engine_dir, devices[i % len(devices)], threads, generation, deadline,
                                           heartbeat, ranks) for i in range(max(workers, 1))]
        self.metrics = metrics
        if metrics is not None and generation is not None:
            for w in self.workers:
                w.on_prefix = self._count_prefix
        self._supervisor: asyncio.Task | None = None
        self._restarting: set[asyncio.Task] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for w in self.workers:
            w.loop = loop
        results = await asyncio.gather(*(loop.run_in_executor(w.executor, w.load) for w in self.workers),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.stop()
            raise failed[0]
        self._gauge()
        self._supervisor = loop.create_task(self._supervise())

    async def stop(self) -> None:
        if self._supervisor:
            self._supervisor.cancel()
        for task in self._restarting:
            task.cancel()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, w.stop) for w in self.workers), return_exceptions=True)
        for w in self.workers:
            w.executor.shutdown(wait=False)

    def pick(self) -> Worker:
        ready = [w for w in self.workers if w.ready]
        if not ready:
            raise Unavailable(f"no worker is ready ({len(self.workers)} restarting); retry shortly")
        return min(ready, key=lambda w: w.load_now)

    async def run(self, rows: list[list[int]], worker: Worker | None = None):
        worker = worker or self.pick()
        worker.outstanding += len(rows)
        call = asyncio.get_running_loop().run_in_executor(worker.executor, worker.call, rows)
        try:
            if not worker.inline:  # a worker process enforces the deadline itself, and is killed if it misses it
                return await call
            try:
                return await asyncio.wait_for(call, self.deadline)
            except TimeoutError:
                raise Unavailable(f"the in-process worker did not answer within {self.deadline:g} s "
                                  "(--worker-timeout); retry the request") from None
        finally:
            worker.outstanding -= len(rows)

    async def probe(self, check) -> None:
        """Run `check(worker)` (real work) on every ready worker; each success refreshes its probe time."""
        for w in [w for w in self.workers if w.ready]:
            try:
                await check(w)
                w.last_probe_ok = time.monotonic()
            except Exception as exc:
                log.warning("worker %d failed its health probe: %s", w.index, exc)

    def healthy(self, within: float) -> bool:
        now = time.monotonic()
        return all(w.ready and now - w.last_probe_ok <= within for w in self.workers)

    def status(self) -> list[dict]:
        return [entry for w in self.workers for entry in w.status()]

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for w in self.workers:
                try:
                    self._check(w)
                except Exception:  # noqa: BLE001 - the supervisor itself must never stop
                    log.exception("supervising worker %d failed", w.index)

    def _check(self, w: Worker) -> None:
        quiet = w.silent()
        if quiet is not None:  # stopped or wedged: whatever it held fails now, not at the step deadline
            why = f"no heartbeat for {quiet:.1f} s (--heartbeat-timeout {w.heartbeat_timeout:g})"
        elif w.stalled():
            why = f"it held sequences and made no progress for {w.deadline:g} s (--worker-timeout)"
        else:
            why = None
        if why is not None and w.hung(why):
            self._restarted(w)
        if w.died():
            w.ready = False
            if w.revive():
                w.ready = True
                self._restarted(w)
                return
            self._gauge()
            task = asyncio.get_running_loop().create_task(self._restart(w))
            self._restarting.add(task)
            task.add_done_callback(self._restarting.discard)

    def _count_prefix(self, queries: int, hits: int) -> None:
        self.metrics.prefix_queries.inc(max(queries, 0))
        self.metrics.prefix_hits.inc(max(hits, 0))

    def _restarted(self, w: Worker) -> None:
        w.restarts += 1
        if self.metrics is not None:
            self.metrics.worker_restarts.inc()

    async def _restart(self, w: Worker) -> None:
        loop = asyncio.get_running_loop()
        for attempt in range(10**9):
            try:
                # on the worker's own thread: the calls queued behind the dead one fail with 503 first
                await loop.run_in_executor(w.executor, w.load)
                break
            except Exception as exc:
                wait = RESTART_BACKOFF[min(attempt, len(RESTART_BACKOFF) - 1)]
                log.error("worker %d failed to restart (%s); next try in %g s", w.index, exc, wait)
                await asyncio.sleep(wait)
        self._restarted(w)
        self._gauge()
        log.info("worker %d restarted as pid %d", w.index, w.pid)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.workers_ready.set(sum(w.ready for w in self.workers))

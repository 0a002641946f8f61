"""Generation across the worker boundary (its messages: server/messages.py). The worker side runs the continuous
batcher: it takes AddSequences and CancelSequence between decode steps and sends each step's events back in one
StepEvents. The server side writes to the pipe from a thread of its own (the event loop
never blocks on a full pipe) and reads on another thread, routing every event to the asyncio queue
of its sequence; if the worker dies or stops making progress, every sequence it held gets an error.

A failure inside one sequence (bad parameters, logits that are not numbers) ends that sequence;
a failure of a whole step ends the sequences of that step; the loop itself goes on, unless the backend
is lost (a track engine's ranks failed): then the loop ends, and its worker is restarted."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue as queue_module
import threading
import time
from collections.abc import Callable

from trtserve.runtime.base import BackendLost
from trtserve.runtime.events import Event, Failure, failed, lost
from trtserve.runtime.sampling import SamplingParams
from trtserve.server.messages import AddSequences, CancelSequence, NewSequence, StepEvents, StopWorker

log = logging.getLogger("trtserve.server")
_ids = itertools.count()


def new_batcher(text, max_num_seqs: int, max_batched_tokens: int, max_prefill_tokens: int | None = None,
                prefix_cache_mib: int = 0):
    """A batcher over `text`'s backend with the sessions it decodes with loaded: a worker builds its
    first one before it reports ready, so that loading never counts against a step's deadline. Its
    grammar constraints and prefix cache are the worker's, kept across batchers."""
    from trtserve.runtime.constraints import Constraints
    from trtserve.runtime.slot_batching import SlotBatcher, make_batcher

    batcher = make_batcher(text.backend, text.eos_ids, max_num_seqs, max_batched_tokens, text.pad_id,
                           max_prefill_tokens)
    if getattr(text, "constraints", None) is None:  # kept across batchers: its grammar tokenizer is costly
        text.constraints = Constraints(text.tokenizer, batcher.vocab, text.eos_ids)
    batcher.constraints = text.constraints
    if isinstance(batcher, SlotBatcher) and prefix_cache_mib:
        if getattr(text, "prefix_cache", None) is None:
            from trtserve.runtime.prefix_cache import PrefixCache

            text.prefix_cache = PrefixCache(prefix_cache_mib * 1024 * 1024)
        batcher.prefix_cache = text.prefix_cache
    if not isinstance(batcher, SlotBatcher):
        getattr(text.backend, "session", None)  # ONNX Runtime loads its session on first use
    return batcher


class ServerGone(Exception):
    """The pipe broke while a step sent its first tokens: the server is gone, the step did not fail."""


def generation_loop(conn, text, max_num_seqs: int, max_batched_tokens: int, max_prefill_tokens: int | None = None,
                    prefix_cache_mib: int = 0, batcher=None) -> None:
    """Worker side: serve AddSequences, CancelSequence and StopWorker messages. `batcher`: one already built by
    new_batcher with the same options."""

    def fresh():
        return new_batcher(text, max_num_seqs, max_batched_tokens, max_prefill_tokens, prefix_cache_mib)

    batcher = fresh() if batcher is None else batcher
    cache = getattr(batcher, "prefix_cache", None)
    reported = (cache.queries, cache.hits) if cache is not None else (0, 0)  # an inline worker's cache outlives a loop

    def send(events: list[Event]) -> None:
        nonlocal reported
        cache = getattr(batcher, "prefix_cache", None)
        totals = (cache.queries, cache.hits) if cache is not None else reported
        queried, found = totals[0] - reported[0], totals[1] - reported[1]  # new since the last message
        reported = totals
        # sequences in a chunked prefill count as running: admitted, holding cache rows
        conn.send(StepEvents(events, batcher.running + batcher.prefilling, len(batcher.waiting), queried, found))

    def first_tokens(early: list[Event]) -> None:  # a prefill's first tokens go out before the step's decode call
        try:
            send(refused + early)
        except (EOFError, OSError) as exc:
            raise ServerGone from exc
        refused.clear()

    while True:
        try:
            waiting = not batcher.has_work()
            refused: list[Event] = []
            while conn.poll(None if waiting else 0):  # block only when there is nothing to decode
                message = conn.recv()
                waiting = False
                if isinstance(message, StopWorker):
                    return
                if isinstance(message, AddSequences):
                    for seq in message.sequences:
                        try:
                            batcher.add(seq.id, seq.prompt, seq.params)
                        except Exception as exc:  # noqa: BLE001 - this sequence fails, the loop goes on
                            refused.append(failed(seq.id, exc))
                elif isinstance(message, CancelSequence):
                    batcher.cancel(message.id)
                else:
                    log.error("generation worker: an unknown message %s is ignored", type(message).__name__)
            try:
                events = refused + batcher.step(first_tokens)
            except BackendLost as exc:  # the backend's processes are gone: so is this worker, which is restarted
                log.error("generation worker: %s; leaving so that it is started afresh", exc)
                return
            except ServerGone:
                return
            except Exception as exc:  # noqa: BLE001 - a bug in a step: its sequences fail, the worker lives
                log.exception("generation step failed")
                held = dict.fromkeys(s.id for s in batcher.held())
                events = refused + [failed(i, exc) for i in held]
                batcher = fresh()
            send(events)
        except (EOFError, OSError):  # the server is gone
            return


class GenerationChannel:
    """Server side of one worker's pipe. `progress` is when the worker last answered; while it holds
    sequences it must answer at least once per deadline (WorkerPool kills it otherwise)."""

    def __init__(self, conn, loop: asyncio.AbstractEventLoop):
        self.conn, self.loop = conn, loop
        self.streams: dict[str, asyncio.Queue] = {}
        self.tokens: dict[str, int] = {}  # prompt tokens of every open sequence, for admission
        self.closed = False
        self.running = self.waiting = 0  # as the worker reported after its last step
        # called with the prompt tokens the worker looked up in its prefix cache, and found there, since its last step
        self.on_prefix: Callable[[int, int], None] | None = None
        self.progress = time.monotonic()
        self._outbox: queue_module.SimpleQueue = queue_module.SimpleQueue()
        threading.Thread(target=self._write, name="trtserve-generation-writer", daemon=True).start()
        threading.Thread(target=self._read, name="trtserve-generation-reader", daemon=True).start()

    def open(self, sequences: list[tuple[list[int], SamplingParams]]) -> list[tuple[str, asyncio.Queue]]:
        """Send (prompt ids, params) sequences to the worker in one message; (id, event queue) of each."""
        if not self.streams:  # the worker was idle: its deadline counts from now
            self.progress = time.monotonic()
        opened, message = [], []
        for prompt, params in sequences:
            seq_id = f"seq-{next(_ids)}"
            queue: asyncio.Queue = asyncio.Queue()
            self.streams[seq_id], self.tokens[seq_id] = queue, len(prompt)
            opened.append((seq_id, queue))
            message.append(NewSequence(seq_id, list(prompt), params))
        self._outbox.put(AddSequences(message))
        return opened

    def close(self, seq_id: str) -> None:
        """The server is done with a sequence: cancel it in the worker unless the worker ended it
        (a stop string found here, a client gone, a deadline: the worker would go on otherwise)."""
        self.tokens.pop(seq_id, None)
        if self.streams.pop(seq_id, None) is not None:
            self._outbox.put(CancelSequence(seq_id))

    def queued_tokens(self) -> int:
        return sum(self.tokens.values())

    def stalled(self, deadline: float) -> bool:
        """True when the worker holds sequences and has not answered for `deadline` seconds."""
        return bool(self.streams) and not self.closed and time.monotonic() - self.progress > deadline

    def stop_worker(self) -> None:
        self._outbox.put(StopWorker())

    def fail(self, why: Failure) -> None:
        """Give up on the worker (hung, or gone): every open sequence ends with `why`; nothing more is sent."""
        self.closed = True
        self._outbox.put(None)
        self.loop.call_soon_threadsafe(self._fail_all, why)

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, ValueError):
                self.closed = True  # the reader reports the death to every stream
                return

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError, TypeError, ValueError):
                break
            if not isinstance(message, StepEvents):
                log.error("generation worker sent an unknown message %s; it is treated as gone",
                          type(message).__name__)
                break
            self.progress = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(self._dispatch, message)
            except RuntimeError:  # the server's loop is gone (shutdown)
                break
        self.closed = True
        self.running = self.waiting = 0
        self._outbox.put(None)
        try:
            self.loop.call_soon_threadsafe(self._fail_all, Failure.WORKER_DIED)
        except RuntimeError:  # the server's loop is gone (shutdown): nobody is waiting
            pass

    def _dispatch(self, step: StepEvents) -> None:
        # also after `closed`: a dying worker's last events still reach their streams (_fail_all,
        # which runs after, answers the rest; a hung worker's streams were already failed and dropped)
        self.running, self.waiting = step.running, step.waiting
        if (step.prefix_queried or step.prefix_found) and self.on_prefix is not None:
            self.on_prefix(step.prefix_queried, step.prefix_found)
        for event in step.events:
            queue = self.streams.get(event.id)
            if queue is not None:
                queue.put_nowait(event)
                if event.ended:  # ended in the worker: no longer held there
                    self.streams.pop(event.id, None)
                    self.tokens.pop(event.id, None)

    def _fail_all(self, why: Failure) -> None:
        for seq_id, queue in list(self.streams.items()):
            queue.put_nowait(lost(seq_id, why))
        self.streams.clear()
        self.tokens.clear()

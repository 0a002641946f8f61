"""Generation across the worker boundary. The worker side runs the continuous batcher: it takes
("add", ...) and ("cancel", id) messages between decode steps and sends each step's new tokens
back in one message. The server side reads those on a thread and routes every event to the
asyncio queue of its sequence; if the worker dies, every sequence it held gets an error."""

from __future__ import annotations

import asyncio
import itertools
import threading

from trtserve.runtime.sampling import SamplingParams

_ids = itertools.count()


def generation_loop(conn, text, max_num_seqs: int, max_batched_tokens: int) -> None:
    """Worker side: serve ("add", (id, prompt ids, params dict)), ("cancel", id), ("stop", None)."""
    from trtserve.runtime.batching import ContinuousBatcher

    batcher = ContinuousBatcher(text.backend, text.eos_ids, max_num_seqs, max_batched_tokens, text.pad_id)
    while True:
        try:
            waiting = not batcher.has_work()
            while conn.poll(None if waiting else 0):  # block only when there is nothing to decode
                op, payload = conn.recv()
                waiting = False
                if op == "stop":
                    return
                if op == "add":
                    seq_id, prompt, params = payload
                    batcher.add(seq_id, prompt, SamplingParams(**params))
                elif op == "cancel":
                    batcher.cancel(payload)
            events = batcher.step()
            conn.send(("events", ([e.__dict__ for e in events], batcher.running, len(batcher.waiting))))
        except (EOFError, OSError):  # the server is gone
            return


class GenerationChannel:
    """Server side of one worker's pipe."""

    def __init__(self, conn, loop: asyncio.AbstractEventLoop):
        self.conn, self.loop = conn, loop
        self.streams: dict[str, asyncio.Queue] = {}
        self.lock = threading.Lock()
        self.closed = False
        self.running = self.waiting = 0  # as the worker reported after its last step
        threading.Thread(target=self._read, name="trtserve-generation-reader", daemon=True).start()

    def open(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        seq_id = f"seq-{next(_ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[seq_id] = queue
        self._send(("add", (seq_id, prompt, params.to_dict())))
        return seq_id, queue

    def close(self, seq_id: str, cancel: bool) -> None:
        if self.streams.pop(seq_id, None) is not None and cancel:
            self._send(("cancel", seq_id))

    def stop_worker(self) -> None:
        self._send(("stop", None))

    def _send(self, message) -> None:
        with self.lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):
                self.closed = True  # the reader reports the death to every stream

    def _read(self) -> None:
        while True:
            try:
                kind, (events, running, waiting) = self.conn.recv()
            except (EOFError, OSError, TypeError, ValueError):
                break
            self.loop.call_soon_threadsafe(self._dispatch, events, running, waiting)
        self.closed = True
        self.running = self.waiting = 0
        self.loop.call_soon_threadsafe(self._fail_all)

    def _dispatch(self, events: list[dict], running: int, waiting: int) -> None:
        self.running, self.waiting = running, waiting
        for event in events:
            queue = self.streams.get(event["id"])
            if queue is not None:
                queue.put_nowait(event)

    def _fail_all(self) -> None:
        for seq_id, queue in list(self.streams.items()):
            queue.put_nowait({"id": seq_id, "token": -1, "error": "worker_died"})
        self.streams.clear()

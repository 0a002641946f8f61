"""Dynamic batching in front of the workers: a bounded queue; batches of up to max_batch rows and
max_tokens padded tokens, collected for at most max_wait_ms; up to `concurrency` batches in flight
(one per worker); results routed back to each caller. A caller that has gone (timeout, client
disconnect) is dropped before any work is done for it."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from trtserve.server.errors import Overloaded


@dataclass
class _Item:
    row: list[int]
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


class DynamicBatcher:
    def __init__(self, run_batch: Callable[[list[list[int]]], Awaitable[list]], max_batch: int,
                 max_wait_ms: float, max_queue: int, max_tokens: int | None = None, concurrency: int = 1,
                 metrics=None):
        self.run_batch, self.max_batch, self.max_wait = run_batch, max_batch, max_wait_ms / 1000
        self.max_tokens = max_tokens
        self.queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=max_queue)
        self.metrics = metrics
        self._held: deque[_Item] = deque()  # taken from the queue but over the last batch's token budget
        self._slots = asyncio.Semaphore(concurrency)
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._running, return_exceptions=True)

    def waiting(self) -> int:
        return self.queue.qsize() + len(self._held)

    async def submit(self, row: list[int]):
        """Queue one row; return its result. Raises Overloaded when the queue is full."""
        return (await self.submit_many([row]))[0]

    async def submit_many(self, rows: list[list[int]]) -> list:
        """Queue all rows or none (Overloaded when they do not fit); return their results in order.
        Cancelling the caller cancels the rows, which are then dropped unrun."""
        if self.queue.maxsize - self.queue.qsize() < len(rows):
            raise Overloaded(f"the queue is full: it cannot take {len(rows)} more rows ({self.queue.qsize()} of "
                             f"{self.queue.maxsize} waiting); retry shortly")
        loop = asyncio.get_running_loop()
        items = [_Item(row, loop.create_future()) for row in rows]
        for item in items:
            self.queue.put_nowait(item)
        self._observe("queue_size", self.waiting())
        return await asyncio.gather(*(item.future for item in items))

    def _next_nowait(self) -> _Item | None:
        if self._held:
            return self._held.popleft()
        return None if self.queue.empty() else self.queue.get_nowait()

    def _fits(self, batch: list[_Item], item: _Item) -> bool:
        if self.max_tokens is None:
            return True
        longest = max(len(item.row), *(len(i.row) for i in batch))
        return (len(batch) + 1) * longest <= self.max_tokens  # rows are padded to the longest

    async def _collect(self) -> list[_Item]:
        first = self._next_nowait() or await self.queue.get()
        batch = [first]
        deadline = time.perf_counter() + self.max_wait
        while len(batch) < self.max_batch:
            item = self._next_nowait()
            if item is None:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                item = await self._get_within(remaining)
                if item is None:
                    break
            if not self._fits(batch, item):
                self._held.appendleft(item)  # first in the next batch
                break
            batch.append(item)
        live = [item for item in batch if not item.future.done()]
        if len(live) < len(batch):
            self._observe("dropped_rows", len(batch) - len(live))
        return live

    async def _get_within(self, seconds: float) -> _Item | None:
        """The next item if one arrives within `seconds`. Not asyncio.wait_for(queue.get()):
        on Python 3.11 a get that completes as the timeout fires is lost with it, and its
        caller would wait forever."""
        getter = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({getter}, timeout=seconds)
        if getter in done:
            return getter.result()
        getter.cancel()
        try:
            return await getter  # it may have completed just before the cancel
        except asyncio.CancelledError:
            return None

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()  # collect only when a worker can take the batch
            batch = await self._collect()
            self._observe("queue_size", self.waiting())
            if not batch:
                self._slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._slots.release()

    async def _run(self, batch: list[_Item]) -> None:
        now = time.perf_counter()
        for item in batch:
            self._observe("queue_time", now - item.enqueued)
        self._observe("batch_size", len(batch))
        try:
            started = time.perf_counter()
            results = await self.run_batch([i.row for i in batch])
            self._observe("inference_time", time.perf_counter() - started)
        except Exception as exc:  # the batch failed: every caller in it gets the error
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        for item, result in zip(batch, results):
            if not item.future.done():
                item.future.set_result(result)

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

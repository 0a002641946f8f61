"""Dynamic batching in front of one backend: a bounded queue, batches of up to max_batch rows
collected for at most max_wait_ms, run off the event loop, results routed back to each caller."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from trtserve.server.errors import Overloaded


@dataclass
class _Item:
    row: list[int]
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


class DynamicBatcher:
    def __init__(self, run_batch: Callable, max_batch: int, max_wait_ms: float, max_queue: int, metrics=None):
        self.run_batch, self.max_batch, self.max_wait = run_batch, max_batch, max_wait_ms / 1000
        self.queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=max_queue)
        self.metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trtserve-backend")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def submit(self, row: list[int]):
        """Queue one row; return its result. Raises Overloaded when the queue is full."""
        item = _Item(row, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            raise Overloaded(f"the queue is full ({self.queue.maxsize} waiting); retry shortly") from None
        self._observe("queue_size", self.queue.qsize())
        return await item.future

    async def _collect(self) -> list[_Item]:
        batch = [await self.queue.get()]
        deadline = time.perf_counter() + self.max_wait
        while len(batch) < self.max_batch:
            if not self.queue.empty():
                batch.append(self.queue.get_nowait())
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            item = await self._get_within(remaining)
            if item is None:
                break
            batch.append(item)
        # callers that timed out or went away are dropped before any work is done for them
        return [item for item in batch if not item.future.done()]

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
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            self._observe("queue_size", self.queue.qsize())
            if not batch:
                continue
            now = time.perf_counter()
            for item in batch:
                self._observe("queue_time", now - item.enqueued)
            self._observe("batch_size", len(batch))
            try:
                started = time.perf_counter()
                results = await loop.run_in_executor(self._executor, self.run_batch, [i.row for i in batch])
                self._observe("inference_time", time.perf_counter() - started)
            except Exception as exc:  # the backend failed: every caller in the batch gets the error
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            for item, result in zip(batch, results):
                if not item.future.done():
                    item.future.set_result(result)

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

"""The dynamic batcher's rules: row and token budgets, all-or-nothing queueing, dropped callers,
one batch in flight per worker. The batch function here sums token ids, so results are checkable."""

import asyncio

import pytest

from trtserve.server.errors import Overloaded
from trtserve.server.scheduler import DynamicBatcher


class Recorder:
    def __init__(self, delay: float = 0.0):
        self.batches, self.delay, self.in_flight, self.most_in_flight = [], delay, 0, 0

    async def __call__(self, rows):
        self.batches.append([len(r) for r in rows])
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        return [sum(r) for r in rows]


def run(coro):
    return asyncio.run(coro)


async def with_batcher(recorder, body, **options):
    batcher = DynamicBatcher(recorder, **{"max_batch": 8, "max_wait_ms": 20, "max_queue": 64, **options})
    batcher.start()
    try:
        return await body(batcher)
    finally:
        await batcher.stop()


def test_results_go_back_to_each_caller_in_order():
    recorder = Recorder()
    rows = [[i, i + 1] for i in range(20)]
    results = run(with_batcher(recorder, lambda b: b.submit_many(rows)))
    assert results == [sum(r) for r in rows]
    assert all(len(batch) <= 8 for batch in recorder.batches) and sum(map(len, recorder.batches)) == 20


def test_token_budget_limits_padded_tokens_per_batch():
    recorder = Recorder()
    rows = [[1] * 10] * 4 + [[1] * 40] + [[1] * 10] * 3
    run(with_batcher(recorder, lambda b: b.submit_many(rows), max_tokens=60))
    for batch in recorder.batches:
        assert len(batch) * max(batch) <= 60 or len(batch) == 1, recorder.batches
    assert [n for batch in recorder.batches for n in batch] == [len(r) for r in rows]  # order kept


def test_a_row_longer_than_the_budget_still_runs_alone():
    recorder = Recorder()
    run(with_batcher(recorder, lambda b: b.submit_many([[1] * 5, [1] * 100, [1] * 5]), max_tokens=50))
    assert [100] in recorder.batches


def test_queueing_is_all_or_nothing():
    async def body(batcher):
        blocker = asyncio.ensure_future(batcher.submit_many([[1]] * 6))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="cannot take 5 more rows"):
            await batcher.submit_many([[2]] * 5)
        assert batcher.waiting() <= 6  # nothing of the refused request was queued
        return await blocker

    assert run(with_batcher(Recorder(0.05), body, max_queue=10, max_batch=2)) == [1] * 6


def test_a_cancelled_caller_is_dropped_before_its_rows_run():
    recorder = Recorder(0.05)

    async def body(batcher):
        first = asyncio.ensure_future(batcher.submit_many([[7]] * 2))
        gone = asyncio.ensure_future(batcher.submit_many([[9]] * 6))
        await asyncio.sleep(0.01)  # the first batch is running; the second caller is still queued
        gone.cancel()
        return await first

    assert run(with_batcher(recorder, body, max_batch=2, max_wait_ms=0)) == [7, 7]
    assert sum(map(len, recorder.batches)) < 8


def test_one_batch_in_flight_per_worker():
    recorder = Recorder(0.02)
    run(with_batcher(recorder, lambda b: b.submit_many([[1]] * 40), max_batch=4, concurrency=3))
    assert recorder.most_in_flight == 3

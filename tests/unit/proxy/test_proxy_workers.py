"""WorkPool: bounded queue (503), deadlines that drop queued jobs (504), cancellation frees the slot."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.proxy.errors import ApiError
from services.proxy.prompt.workers import WorkPool


@pytest.fixture
def pool():
    pool = WorkPool("image", threads=1, max_queued=1)
    yield pool
    pool.shutdown()


async def _occupy(pool: WorkPool) -> tuple[threading.Event, asyncio.Task]:
    """Runs a job that holds the pool's one thread until the returned gate is set; returns (gate, its task)."""
    gate, started = threading.Event(), threading.Event()

    def block() -> str:
        started.set()
        assert gate.wait(10), "test gate never opened"
        return "done"

    running = asyncio.create_task(pool.run(block))
    await asyncio.to_thread(started.wait, 10)
    return gate, running


async def _until(predicate) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_a_full_queue_is_a_503_with_retry_after(pool):
    gate, running = await _occupy(pool)
    queued = asyncio.create_task(pool.run(lambda: "queued"))
    await _until(lambda: pool.num_admitted == 2)
    with pytest.raises(ApiError) as refused:
        await pool.run(lambda: "refused")
    assert refused.value.status_code == 503 and refused.value.code == "overloaded"
    assert refused.value.response_headers()["Retry-After"] == "1"
    gate.set()
    assert await running == "done" and await queued == "queued"
    await _until(lambda: pool.num_admitted == 0)


async def test_a_job_whose_deadline_passed_in_the_queue_never_runs(pool):
    gate, running = await _occupy(pool)
    ran = []
    with pytest.raises(ApiError) as late:
        await pool.run(lambda: ran.append(1), deadline=time.monotonic() + 0.05)
    assert late.value.status_code == 504
    gate.set()
    await running
    await _until(lambda: pool.num_admitted == 0)
    assert ran == []  # taken out of the queue when its caller gave up


async def test_a_cancelled_caller_frees_its_slot(pool):
    gate, running = await _occupy(pool)
    waiting = asyncio.create_task(pool.run(lambda: "never"))
    await _until(lambda: pool.num_admitted == 2)
    waiting.cancel()
    await _until(lambda: pool.num_admitted == 1)
    gate.set()
    await running


async def test_errors_of_the_job_reach_the_caller_and_free_the_slot(pool):
    def fails():
        raise ValueError("bad input")

    with pytest.raises(ValueError):
        await pool.run(fails)
    await _until(lambda: pool.num_admitted == 0)


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError):
        WorkPool("text", threads=0, max_queued=1)

"""ByteBudget: the outbound byte bound of the pusher (FIFO, oversize, cancellation)."""

from __future__ import annotations

import asyncio

import pytest

from services.encoder.pusher import ByteBudget


async def test_acquire_within_capacity_is_immediate() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    await budget.acquire(40)
    assert budget.in_use == 100
    budget.release(100)
    assert budget.in_use == 0


async def test_acquire_waits_for_release() -> None:
    budget = ByteBudget(100)
    await budget.acquire(80)
    waiter = asyncio.create_task(budget.acquire(50))
    await asyncio.sleep(0.01)
    assert not waiter.done() and budget.in_use == 80
    budget.release(80)
    await asyncio.wait_for(waiter, 1)
    assert budget.in_use == 50


async def test_waiters_are_served_in_order() -> None:
    budget = ByteBudget(100)
    await budget.acquire(100)
    order: list[str] = []

    async def take(name: str, num_bytes: int) -> None:
        await budget.acquire(num_bytes)
        order.append(name)

    big = asyncio.create_task(take("big", 90))
    await asyncio.sleep(0)
    small = asyncio.create_task(take("small", 10))  # would fit after a partial release, but queues behind big
    await asyncio.sleep(0.01)
    budget.release(100)
    await asyncio.wait_for(asyncio.gather(big, small), 1)
    assert order == ["big", "small"] and budget.in_use == 100


async def test_oversize_request_is_admitted_when_idle() -> None:
    budget = ByteBudget(10)
    await budget.acquire(50)
    assert budget.in_use == 50
    waiter = asyncio.create_task(budget.acquire(1))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    budget.release(50)
    await asyncio.wait_for(waiter, 1)
    assert budget.in_use == 1


async def test_cancelled_waiter_leaks_nothing_and_unblocks_the_queue() -> None:
    budget = ByteBudget(100)
    await budget.acquire(100)
    head = asyncio.create_task(budget.acquire(100))
    await asyncio.sleep(0)
    behind = asyncio.create_task(budget.acquire(10))
    await asyncio.sleep(0.01)
    head.cancel()
    with pytest.raises(asyncio.CancelledError):
        await head
    budget.release(100)
    await asyncio.wait_for(behind, 1)
    assert budget.in_use == 10

"""``WriteBound``: how long one response write may wait for the client."""

from __future__ import annotations

import asyncio

import pytest

from services.proxy.web.bounded_responses import WRITE_GRACE_S, WriteBound, WriteStalled


def test_a_write_gets_until_the_deadline_or_the_grace_and_never_more_than_the_stall_bound():
    bound = WriteBound(deadline=100.0)
    assert bound.limit_s(90.0) == 10.0  # until the deadline
    assert bound.limit_s(99.9) == WRITE_GRACE_S  # a write starting near or after it still gets the grace
    assert bound.limit_s(150.0) == WRITE_GRACE_S
    assert WriteBound(deadline=100.0, stall_s=2.0).limit_s(90.0) == 2.0
    assert WriteBound(deadline=100.0, stall_s=2.0).limit_s(99.9) == WRITE_GRACE_S


async def test_a_send_that_cannot_complete_raises_write_stalled_and_is_counted_once():
    stalls: list[int] = []
    bound = WriteBound(deadline=0.0, stall_s=0.05, on_stall=lambda: stalls.append(1))
    never = asyncio.Event()

    async def blocked_send(message):
        await never.wait()

    sent: list[dict] = []

    async def quick_send(message):
        sent.append(message)

    await bound.wrap(quick_send)({"type": "http.response.body"})
    assert sent and not stalls
    with pytest.raises(WriteStalled):
        await asyncio.wait_for(bound.wrap(blocked_send)({"type": "http.response.body"}), 5)
    assert stalls == [1]

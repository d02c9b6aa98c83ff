"""``ImageWindows``: at most N image requests per PD between their Preallocate and their first token."""

from __future__ import annotations

import asyncio

import pytest

from services.proxy.dispatch.image_window import ImageWindows


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_requests_beyond_the_window_wait_and_enter_in_arrival_order():
    windows = ImageWindows(2)
    order: list[int] = []

    async def request(index: int) -> None:
        await windows.enter("pd-a")
        order.append(index)

    tasks = [asyncio.create_task(request(i)) for i in range(5)]
    await _settle()
    assert order == [0, 1] and windows.num_inside("pd-a") == 2 and windows.num_waiting() == 3
    windows.leave("pd-a")
    await _settle()
    assert order == [0, 1, 2]
    windows.leave("pd-a")
    windows.leave("pd-a")
    await _settle()
    assert order == [0, 1, 2, 3, 4] and windows.num_waiting() == 0
    await asyncio.gather(*tasks)
    for _ in range(2):
        windows.leave("pd-a")
    assert windows.num_inside("pd-a") == 0


async def test_each_pd_has_its_own_window():
    windows = ImageWindows(1)
    await windows.enter("pd-a")
    await asyncio.wait_for(windows.enter("pd-b"), 1.0)  # pd-a's full window holds nobody on pd-b
    waiting = asyncio.create_task(windows.enter("pd-a"))
    await _settle()
    assert not waiting.done()
    windows.leave("pd-a")
    await asyncio.wait_for(waiting, 1.0)


async def _full_window_and_two_waiting() -> tuple[ImageWindows, asyncio.Task, asyncio.Task]:
    """A window of 1 on pd-a, taken, and two requests waiting for it: the first, then the next."""
    windows = ImageWindows(1)
    await windows.enter("pd-a")
    first = asyncio.create_task(windows.enter("pd-a"))
    after = asyncio.create_task(windows.enter("pd-a"))
    await _settle()
    return windows, first, after


async def test_a_waiter_cancelled_holds_no_place():
    windows, gone, after = await _full_window_and_two_waiting()
    gone.cancel()
    await _settle()
    assert windows.num_waiting() == 1
    windows.leave("pd-a")
    await asyncio.wait_for(after, 1.0)
    assert windows.num_inside("pd-a") == 1


async def test_a_place_given_to_a_waiter_cancelled_meanwhile_goes_to_the_next():
    windows, gone, after = await _full_window_and_two_waiting()
    windows.leave("pd-a")  # the place goes to ``gone``'s turn ...
    gone.cancel()  # ... before its task resumes to take it
    with pytest.raises(asyncio.CancelledError):
        await gone
    await asyncio.wait_for(after, 1.0)
    assert windows.num_inside("pd-a") == 1 and windows.num_waiting() == 0


async def test_a_window_of_zero_never_waits():
    windows = ImageWindows(0)
    for _ in range(100):
        await asyncio.wait_for(windows.enter("pd-a"), 1.0)
    windows.leave("pd-a")
    assert windows.num_inside("pd-a") == 0 and windows.num_waiting() == 0


def test_a_negative_window_is_refused():
    with pytest.raises(ValueError, match="image window"):
        ImageWindows(-1)

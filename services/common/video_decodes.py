"""Video items are decoded on threads of their own, a bounded number at once.

Decoding a video is CPU work that can take seconds (every frame up to the
last sampled one), far more than parsing an image. Encode calls with a video
item (the encoder's, ``--video-threads``, 1 by default, and a colocated PD's)
parse on ``VideoDecodes`` instead of the default executor, so videos neither
crowd out image calls nor decode more at once than configured; the calls
waiting for a thread are bounded too (beyond the bound ``DecodesFull``, which
each service answers RESOURCE_EXHAUSTED). A call that ends (answered,
cancelled, past its deadline) cancels its ``DecodeBudget``: its decode stops
at the next frame, or never starts when it was still queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from services.common.bounded_pool import BoundedPool, PoolFull

T = TypeVar("T")
RETRY_AFTER_MS = 500
"""When a caller refused for a full queue may try again (a queued decode ends within its call's deadline)."""


class DecodesFull(Exception):
    """Every decode thread and queue slot is taken (RESOURCE_EXHAUSTED, retry after ``RETRY_AFTER_MS``)."""


class VideoDecodes(BoundedPool):
    """``threads`` decode threads and at most ``max_queued`` calls waiting for one."""

    def __init__(self, threads: int, max_queued: int) -> None:
        super().__init__(threads, max_queued, thread_name_prefix="video-decode")

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a decode thread; ``DecodesFull`` when every thread and queue slot is taken."""
        try:
            future = self.submit(fn)
        except PoolFull:
            raise DecodesFull("too many videos waiting to be decoded") from None
        return await asyncio.wrap_future(future)  # cancelling this cancels a job that has not started

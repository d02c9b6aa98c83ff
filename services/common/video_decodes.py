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
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
RETRY_AFTER_MS = 500
"""When a caller refused for a full queue may try again (a queued decode ends within its call's deadline)."""


class DecodesFull(Exception):
    """Every decode thread and queue slot is taken (RESOURCE_EXHAUSTED, retry after ``RETRY_AFTER_MS``)."""


class VideoDecodes:
    """``threads`` decode threads and at most ``max_queued`` calls waiting for one."""

    def __init__(self, threads: int, max_queued: int) -> None:
        if threads < 1 or max_queued < 0:
            raise ValueError("threads >= 1 and max_queued >= 0 are required")
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="video-decode")
        self._capacity = threads + max_queued
        self._lock = threading.Lock()
        self._num_admitted = 0  # queued + running, released when the job's future is done

    @property
    def num_admitted(self) -> int:
        """Decodes queued or running (0 when idle: leak checks)."""
        with self._lock:
            return self._num_admitted

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a decode thread; ``DecodesFull`` when every thread and queue slot is taken."""
        with self._lock:
            if self._num_admitted >= self._capacity:
                raise DecodesFull("too many videos waiting to be decoded")
            self._num_admitted += 1
        try:
            future = self._executor.submit(fn)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)  # also when cancelled before it started
        return await asyncio.wrap_future(future)  # cancelling this cancels a job that has not started

    def _release(self, _future: object) -> None:
        with self._lock:
            self._num_admitted -= 1

    def shutdown(self) -> None:
        """Drops queued decodes; running ones stop at their next frame once their calls cancel them."""
        self._executor.shutdown(wait=False, cancel_futures=True)

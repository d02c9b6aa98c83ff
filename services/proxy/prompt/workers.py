"""Thread pools for the proxy's CPU work, each with a bounded queue and deadline-aware jobs.

Two pools, so that one kind of work never waits behind the other: text
(chat template and tokenization, for every request) and images (decoding,
hashing, the image processor). A job admitted past the queue bound is
refused at once with 503 + Retry-After instead of piling up; a job whose
request deadline passed while it was queued is dropped when it reaches a
thread instead of running for nobody; a caller that gives up (deadline,
disconnect) takes a job that has not started yet out of the queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from services.common.bounded_pool import BoundedPool, PoolFull
from services.proxy.errors import ApiError, from_grpc

T = TypeVar("T")


class _Expired(Exception):
    """The job's deadline passed before a thread picked it up."""


class WorkPool(BoundedPool):
    """``threads`` workers, at most ``max_queued`` more jobs waiting; ``run`` awaits one job."""

    def __init__(self, name: str, threads: int, max_queued: int, *, retry_after_s: int = 1) -> None:
        super().__init__(threads, max_queued, thread_name_prefix=f"proxy-{name}")
        self.name = name
        self._retry_after_s = retry_after_s

    async def run(self, fn: Callable[..., T], *args: Any, deadline: float | None = None) -> T:
        """``fn(*args)`` on a worker; 503 when the queue is full, 504 at ``deadline`` (``time.monotonic()``)."""

        def job() -> T:
            if deadline is not None and time.monotonic() >= deadline:
                raise _Expired()
            return fn(*args)

        try:
            future = self.submit(job)
        except PoolFull:
            raise ApiError(
                503,
                f"The proxy's {self.name} preprocessing queue is full; retry later.",
                "server_error",
                "overloaded",
                retry_after_s=self._retry_after_s,
            ) from None
        work = asyncio.wrap_future(future)
        try:
            if deadline is None:
                return await work
            return await asyncio.wait_for(work, deadline - time.monotonic())
        except (TimeoutError, _Expired):
            raise from_grpc(grpc.StatusCode.DEADLINE_EXCEEDED) from None

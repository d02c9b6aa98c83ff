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
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from services.proxy.errors import ApiError, from_grpc

T = TypeVar("T")


class _Expired(Exception):
    """The job's deadline passed before a thread picked it up."""


class WorkPool:
    """``threads`` workers, at most ``max_queued`` more jobs waiting; ``run`` awaits one job."""

    def __init__(self, name: str, threads: int, max_queued: int, *, retry_after_s: int = 1) -> None:
        if threads < 1 or max_queued < 0:
            raise ValueError("threads >= 1 and max_queued >= 0 are required")
        self.name = name
        self.capacity = threads + max_queued
        self._retry_after_s = retry_after_s
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"proxy-{name}")
        self._lock = threading.Lock()
        self._num_admitted = 0  # queued + running; released by the job's future, whatever ends it

    @property
    def num_admitted(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return self._num_admitted

    def _admit(self) -> None:
        with self._lock:
            if self._num_admitted >= self.capacity:
                raise ApiError(
                    503,
                    f"The proxy's {self.name} preprocessing queue is full; retry later.",
                    "server_error",
                    "overloaded",
                    retry_after_s=self._retry_after_s,
                )
            self._num_admitted += 1

    def _release(self, _future: Any) -> None:
        with self._lock:
            self._num_admitted -= 1

    async def run(self, fn: Callable[..., T], *args: Any, deadline: float | None = None) -> T:
        """``fn(*args)`` on a worker; 503 when the queue is full, 504 at ``deadline`` (``time.monotonic()``)."""
        self._admit()

        def job() -> T:
            if deadline is not None and time.monotonic() >= deadline:
                raise _Expired()
            return fn(*args)

        try:
            future = self._executor.submit(job)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)  # also when cancelled before it started
        work = asyncio.wrap_future(future)
        try:
            if deadline is None:
                return await work
            return await asyncio.wait_for(work, deadline - time.monotonic())
        except (TimeoutError, _Expired):
            raise from_grpc(grpc.StatusCode.DEADLINE_EXCEEDED) from None

    def shutdown(self) -> None:
        """Drops queued jobs; running ones finish in their threads, unobserved."""
        self._executor.shutdown(wait=False, cancel_futures=True)

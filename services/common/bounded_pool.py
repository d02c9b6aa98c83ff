"""A thread pool with a bounded queue: at most ``threads`` jobs run and ``max_queued`` more wait.

Beyond that, ``submit`` refuses at once (``PoolFull``) instead of letting work
pile up; each service answers the refusal in its own words (a 503 at the
proxy, RESOURCE_EXHAUSTED inside). A job counts from its admission until its
future is done, whatever ends it (finished, failed, or cancelled before it
started), so ``num_admitted`` returns to 0 when the pool is idle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class PoolFull(Exception):
    """Every thread and queue slot is taken."""


class BoundedPool:
    """``threads`` workers and at most ``max_queued`` jobs waiting for one."""

    def __init__(self, threads: int, max_queued: int, thread_name_prefix: str) -> None:
        if threads < 1 or max_queued < 0:
            raise ValueError("threads >= 1 and max_queued >= 0 are required")
        self.capacity = threads + max_queued
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self._num_admitted = 0  # queued + running, released when the job's future is done

    @property
    def num_admitted(self) -> int:
        """Jobs queued or running (0 when idle: leak checks)."""
        with self._lock:
            return self._num_admitted

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queues ``fn``; ``PoolFull`` when every thread and queue slot is taken."""
        with self._lock:
            if self._num_admitted >= self.capacity:
                raise PoolFull()
            self._num_admitted += 1
        try:
            future = self._executor.submit(fn)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)  # also when cancelled before it started
        return future

    def _release(self, _future: object) -> None:
        with self._lock:
            self._num_admitted -= 1

    def shutdown(self) -> None:
        """Drops queued jobs; running ones finish in their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)

"""Micro-batching of vision forwards on a worker thread, with single flight per image.

The event loop enqueues jobs and awaits their futures; one worker thread
dequeues up to ``max_batch_images`` jobs (waiting at most ``max_wait_ms``
after the first), groups the ones that can share a forward (``vision_io.batch_key``:
equal pixel shapes for fixed-size towers; any grids for dynamic-resolution ones,
packed into one forward), runs the vision module under ``torch.inference_mode``
and resolves the futures back on the loop with ``loop.call_soon_threadsafe``.
Tensor work never runs on the event loop.

Locking: one ``threading.Condition`` guards the queue, the in-flight map,
the pending count and every job's ``state``/``num_waiters``/``deadline``.
It is held only for bookkeeping, never across a forward.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.common.models.loaded_vision import embeddings_to_host
from services.common.models.vision_io import Grid, batch_key, encode_images
from services.encoder.cache import EmbeddingCache, cache_key
from services.encoder.errors import DeadlineExceeded, EncodeFailed, EncoderError, Overloaded, ShuttingDown
from services.encoder.metrics import EncoderMetrics

log = logging.getLogger(__name__)


class EncodeResult(NamedTuple):
    """One image's embedding as handed to the servicer."""

    embedding: torch.Tensor  # [num_tokens, hidden] (or [num_tokens, 1 + levels, hidden]) on CPU; shared, never mutate
    encode_s: float  # forward time of the batch that produced it (0 on a cache hit)
    cache_hit: bool


class _State(enum.IntEnum):
    QUEUED = 0
    RUNNING = 1
    DONE = 2


@dataclass(eq=False)
class _Job:
    """One image computation, shared by every waiter asking for the same image (``key``)."""

    key: str  # cache_key(mm_hash, pixels, grid): the same hash with other pixels is another job
    pixel_values: torch.Tensor  # [3, H, W], or patches [t*h*w, D] with a grid
    future: asyncio.Future[EncodeResult]
    deadline: float  # time.monotonic() seconds; the latest deadline of its waiters (inf = none)
    grid: Grid | None = None  # patch grid of a dynamic-resolution image
    num_waiters: int = 1
    state: _State = _State.QUEUED


def _consume_exception(future: asyncio.Future) -> None:
    # A job whose waiters all left still gets resolved; reading the exception
    # keeps asyncio from logging "exception was never retrieved".
    if not future.cancelled():
        future.exception()


class Batcher:
    """Bounded queue + worker thread running a ``VisionEncoder`` on micro-batches.

    ``encode`` returns a cached embedding at once, joins an identical
    in-flight computation, or enqueues a new one (``Overloaded`` when
    ``max_pending`` images are already queued or running).
    """

    def __init__(
        self,
        vision: torch.nn.Module,
        cache: EmbeddingCache,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_images: int,
        max_wait_ms: float,
        max_pending: int,
        metrics: EncoderMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._vision = vision
        self._cache = cache
        self._device = device
        self._dtype = dtype
        self._max_batch = max_batch_images
        self._max_wait_s = max_wait_ms / 1000.0
        self._max_pending = max_pending
        self._metrics = metrics or EncoderMetrics()
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._inflight: dict[str, _Job] = {}
        self._num_pending = 0  # queued + running images
        self._num_images_encoded = 0  # images through a successful forward, ever (single-flight checks)
        self._stopping = False
        self._seconds_per_image = 0.05  # EWMA of forward time per image, for retry-after hints
        self._thread: threading.Thread | None = None
        # When the running forward started (None between forwards), for the watchdog's
        # ``stalled_for``; written by the worker only, and plain attribute writes are atomic.
        self._forward_since: float | None = None

    # ----------------------------------------------------------------- loop side

    def start(self) -> None:
        """Starts the worker thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="encoder-batcher", daemon=True)
            self._thread.start()

    @property
    def num_pending(self) -> int:
        """Images queued or being encoded."""
        with self._cond:
            return self._num_pending

    @property
    def is_alive(self) -> bool:
        """Whether the worker thread runs (True before ``start``: nothing is expected of it yet)."""
        return self._thread is None or self._thread.is_alive()

    def stalled_for(self) -> float:
        """Seconds the running vision forward has taken so far (0 between forwards).

        The worker takes queued work as soon as a forward ends, so a forward
        that does not end is what leaves callers waiting.
        """
        since = self._forward_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    @property
    def num_images_encoded(self) -> int:
        """Images that went through a successful vision forward since start (cumulative)."""
        with self._cond:
            return self._num_images_encoded

    async def encode(
        self, mm_hash: str, pixel_values: torch.Tensor, deadline: float | None, grid: Grid | None = None
    ) -> EncodeResult:
        """The embedding of one image: from the cache, a shared in-flight job, or a new job.

        Cache and single flight are keyed by ``mm_hash`` and a digest of
        ``pixel_values`` and ``grid`` (``cache.cache_key``): a hit is always
        the embedding of these pixels, whatever hash the caller sent with them.
        ``deadline`` is in ``time.monotonic()`` seconds (None = none); ``grid``
        is the patch grid of a dynamic-resolution image. Cancelling the caller
        withdraws it from the job; a queued job nobody waits for is removed at
        once and never computed.
        """
        loop = asyncio.get_running_loop()
        key = await asyncio.to_thread(cache_key, mm_hash, pixel_values, grid)
        job = self._join_or_enqueue(key, pixel_values, math.inf if deadline is None else deadline, loop, grid)
        if isinstance(job, EncodeResult):
            return job
        try:
            # shield: one waiter's cancellation must not cancel the shared job.
            return await asyncio.shield(job.future)
        finally:
            self._leave(job)

    def _join_or_enqueue(
        self,
        key: str,
        pixel_values: torch.Tensor,
        deadline: float,
        loop: asyncio.AbstractEventLoop,
        grid: Grid | None = None,
    ) -> _Job | EncodeResult:
        with self._cond:
            if self._stopping:
                raise ShuttingDown("encoder is shutting down")
            job = self._inflight.get(key)
            if job is not None and job.state is not _State.DONE:
                job.num_waiters += 1
                job.deadline = max(job.deadline, deadline)
                return job
            cached = self._cache.get(key)
            if cached is not None:
                return EncodeResult(cached, 0.0, True)
            if self._num_pending >= self._max_pending:
                retry_ms = self._retry_after_ms()
                self._metrics.on_rejected()
                raise Overloaded("encoder queue is full", retry_after_ms=retry_ms)
            job = _Job(key, pixel_values, loop.create_future(), deadline, grid)
            job.future.add_done_callback(_consume_exception)
            self._inflight[key] = job
            self._queue.append(job)
            self._num_pending += 1
            self._cond.notify()
            return job

    def _leave(self, job: _Job) -> None:
        with self._cond:
            job.num_waiters -= 1
            if job.num_waiters > 0 or job.state is not _State.QUEUED:
                return
            # Nobody waits for it any more: free its queue slot now rather than
            # at dequeue, so admission sees the room immediately.
            self._queue.remove(job)
            self._retire(job)
        job.future.cancel()
        self._metrics.on_dropped(1, "cancelled")

    def _retry_after_ms(self) -> int:
        # Roughly how long the queue ahead takes to drain (lock held by caller).
        batches = math.ceil(self._num_pending / self._max_batch)
        estimate = batches * self._max_batch * self._seconds_per_image * 1000.0
        return int(min(max(estimate, 10.0), 10_000.0))

    # -------------------------------------------------------------- shutdown

    def stop(self, timeout: float | None = None) -> None:
        """Fails queued jobs with UNAVAILABLE and joins the worker (blocking; call off the loop).

        A forward already running completes and resolves its jobs normally.
        """
        with self._cond:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            for job in dropped:
                self._retire(job)
            self._cond.notify_all()
        self._resolve_all(dropped, lambda: ShuttingDown("encoder is shutting down"))
        if dropped:
            self._metrics.on_dropped(len(dropped), "shutdown")
        if self._thread is not None:
            self._thread.join(timeout)

    # ---------------------------------------------------------------- worker side

    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            groups: dict[tuple, list[_Job]] = {}
            for job in batch:  # empty when only expired jobs were dequeued
                key = batch_key(self._vision, job.pixel_values, job.grid)
                groups.setdefault(key, []).append(job)
            for group in groups.values():
                try:
                    self._forward(group)
                except Exception:
                    # A bug outside the forward itself: fail the group rather than
                    # leave its callers waiting, and keep serving.
                    log.exception("encoder worker error")
                    self._fail(group)
                finally:
                    self._forward_since = None

    def _collect(self) -> list[_Job] | None:
        """Blocks for the first live job, then gathers more for up to ``max_wait``.

        Returns None when stopping; an empty list when it only dropped expired jobs.
        """
        batch: list[_Job] = []
        expired: list[_Job] = []
        flush_at = math.inf
        with self._cond:
            while len(batch) < self._max_batch and not self._stopping:
                if self._queue:
                    job = self._queue.popleft()
                    now = self._clock()
                    if now >= job.deadline:
                        self._retire(job)
                        expired.append(job)
                        continue
                    job.state = _State.RUNNING
                    batch.append(job)
                    if len(batch) == 1:
                        flush_at = now + self._max_wait_s
                    continue
                if not batch:
                    if expired:
                        break  # report them before blocking; the caller loops back
                    self._cond.wait()
                    continue
                remaining = flush_at - self._clock()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        if expired:
            self._resolve_all(expired, lambda: DeadlineExceeded("deadline exceeded before encoding"))
            self._report(self._metrics.on_dropped, len(expired), "deadline")
        if not batch and self._stopping:
            return None
        return batch

    def _forward(self, group: list[_Job]) -> None:
        start = time.perf_counter()
        self._forward_since = time.monotonic()
        try:
            out = encode_images(
                self._vision, [(job.pixel_values, job.grid) for job in group], self._device, self._dtype
            )  # [num_tokens, hidden] per image
            rows = embeddings_to_host(out)  # one read-back per batch; each image its own tensor
        except Exception:
            log.exception("vision forward failed for a batch of %d images", len(group))
            self._fail(group)
            self._report(self._metrics.on_batch, len(group), time.perf_counter() - start, False)
            return
        elapsed = time.perf_counter() - start
        for job, row in zip(group, rows):
            self._cache.put(job.key, row)
        with self._cond:
            self._seconds_per_image = 0.8 * self._seconds_per_image + 0.2 * elapsed / len(group)
            self._num_images_encoded += len(group)
            for job in group:
                self._retire(job)
        for job, row in zip(group, rows):
            self._resolve(job, EncodeResult(row, elapsed, False))
        self._report(self._metrics.on_batch, len(group), elapsed, True)

    # ---------------------------------------------------------------- helpers

    @staticmethod
    def _report(hook: Callable[..., None], *args: object) -> None:
        # A broken metrics hook must never stall the worker or lose results.
        try:
            hook(*args)
        except Exception:
            log.exception("encoder metrics hook failed")

    def _fail(self, group: list[_Job]) -> None:
        with self._cond:
            for job in group:
                self._retire(job)
        self._resolve_all(group, lambda: EncodeFailed("vision encoder failed"))

    def _retire(self, job: _Job) -> None:
        """Marks ``job`` finished and frees its pending slot (lock held; idempotent)."""
        if job.state is _State.DONE:
            return
        job.state = _State.DONE
        self._num_pending -= 1
        if self._inflight.get(job.key) is job:
            del self._inflight[job.key]

    def _resolve_all(self, jobs: list[_Job], make_error: Callable[[], EncoderError]) -> None:
        # One exception object per future: a shared one would collect every
        # waiter's traceback.
        for job in jobs:
            self._resolve(job, make_error())

    @staticmethod
    def _resolve(job: _Job, outcome: EncodeResult | EncoderError) -> None:
        def settle() -> None:
            if job.future.done():
                return
            if isinstance(outcome, EncoderError):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

        try:
            job.future.get_loop().call_soon_threadsafe(settle)
        except RuntimeError:
            # The loop is closed: nobody is left to receive the result.
            log.debug("event loop closed before an encode result could be delivered")

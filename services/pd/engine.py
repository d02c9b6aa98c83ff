"""The PD engine: one thread runs the step loop; asyncio talks to it through an inbox.

All policy state (scheduler, KV cache manager, embedding cache) and all
tensors are touched only by the engine thread. The asyncio side submits
commands (plain callables) to a thread-safe inbox and awaits their futures;
per-request events come back on asyncio queues through
``loop.call_soon_threadsafe``. CPU/GPU work never runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.pd.detokenizer import IncrementalDetokenizer
from services.pd.embedding_cache import EmbeddingCache
from services.pd.errors import EngineError, ErrorKind
from services.pd.handoff import Allocation, EmbeddingHandoff
from services.pd.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from services.pd.request import MultiModalSpan, Request, RequestStatus
from services.pd.scheduler import QueueFull, Scheduler
from services.pd.step_stats import StepStats

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request since its last event."""

    token_ids: list[int]
    text: str
    logprobs: list[SampledToken] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    """The request ended normally (or was aborted); carries the final request state."""

    status: RequestStatus
    request: Request


@dataclass(frozen=True)
class Failed:
    """The request ended with an error."""

    error: EngineError


Event = TokenDelta | Finished | Failed


@dataclass
class _Live:
    """Engine-thread bookkeeping of one request with a listening stream."""

    request: Request
    detokenizer: IncrementalDetokenizer
    post: Callable[[Event], None]


class Engine:
    """Owns the scheduler, the caches and the model runner; see the module docstring."""
    num_steps = property(lambda self: self.step_stats.num_steps, doc="Non-empty steps run since start.")

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        embedding_cache: EmbeddingCache,
        runner: Any,
        tokenizer: Any,
        hidden_size: int,
        embedding_store: dict[str, Any],
        prepare_embedding: Callable[[Any], Any],
        lease_sweep_interval_s: float = 0.25,
        thread_init: Callable[[], None] | None = None,
    ):
        self.scheduler = scheduler
        self.embedding_cache = embedding_cache
        self.runner = runner
        self.tokenizer = tokenizer
        self.hidden_size = hidden_size
        # mm_hash -> embedding tensor on the runner's device; entries are
        # removed by the embedding cache's eviction callback.
        self._embeddings = embedding_store
        self.handoff = EmbeddingHandoff(embedding_cache, scheduler.kv_cache, embedding_store, prepare_embedding, scheduler.check_room)
        self._sweep_interval = lease_sweep_interval_s
        # Runs first on the engine thread: per-thread runtime settings (OpenMP's
        # thread count is per thread; oneDNN would otherwise use every core).
        self._thread_init = thread_init
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._thread = threading.Thread(target=self._run, name="pd-engine", daemon=True)
        self._stopping = False
        self._next_sweep = 0.0
        self.step_stats = StepStats()  # steps, their time by phase, tokens; engine thread only
        # Written by the engine thread after every loop iteration, read by the
        # readiness watchdog (``stalled_for``); plain attribute writes are atomic.
        self.last_step_time = time.monotonic()
        self._has_work = False

    # ------------------------------------------------------------------
    # lifecycle
    # ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fails what is still running with UNAVAILABLE and stops the thread."""
        if not self._thread.is_alive():
            return
        self._inbox.put(self._fail_all_for_shutdown)
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds the step loop has made no progress while work is pending (0 = healthy or idle).

        Any thread may call it. The loop comes round at least every lease
        sweep interval even when idle or waiting for images, so only a stuck
        (or very long) step or command makes this grow.
        """
        if not self._has_work and self._inbox.empty():
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self.last_step_time)

    # ------------------------------------------------------------------
    # asyncio-facing API
    # ------------------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn(*args)`` on the engine thread between steps and returns its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def resolve(ok: bool, value: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def command() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(resolve, False, exc)
            else:
                loop.call_soon_threadsafe(resolve, True, result)

        if not self._thread.is_alive() or self._stopping:
            raise EngineError(ErrorKind.UNAVAILABLE, "engine is not running")
        self._inbox.put(command)
        return await future

    async def preallocate(
        self,
        request_id: str,
        spans: Sequence[MultiModalSpan],
        lease_s: float,
        prompt_token_ids: Sequence[int] = (),
    ) -> list[Allocation]:
        """Reserves room for (or pins) the images of a prompt; see ``services/pd/handoff.py``.

        With ``prompt_token_ids``, an image whose prefix is in the KV prefix
        cache is READY without its embedding.
        """
        return await self.call(self._preallocate, request_id, list(spans), lease_s, list(prompt_token_ids))

    async def check_push(self, request_id: str, reservation_id: str, mm_hash: str, num_tokens: int) -> None:
        """Rejects a push early (before its bytes arrive) if its reservation is not live."""
        await self.call(self._check_push, request_id, reservation_id, mm_hash, num_tokens)

    async def push(self, request_id: str, reservation_id: str, mm_hash: str, embedding: Any) -> None:
        """Fills a reservation with ``embedding`` ([num_tokens, hidden]); idempotent per entry."""
        await self.call(self._fill, request_id, reservation_id, mm_hash, embedding)

    async def add_request(self, request: Request) -> asyncio.Queue[Event]:
        """Admits ``request``; its events arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def post(event: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        await self.call(self._add_request, request, post)
        return events

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread; idempotent, unknown ids are ignored."""
        if self._thread.is_alive():
            self._inbox.put(lambda: self._abort(request_id))

    async def stats(self) -> dict[str, int]:
        return await self.call(self._stats)

    # ------------------------------------------------------------------
    # engine thread: commands
    # ------------------------------------------------------------------

    def _preallocate(
        self, request_id: str, spans: list[MultiModalSpan], lease_s: float, prompt_token_ids: list[int]
    ) -> list[Allocation]:
        if request_id in self._live:
            raise EngineError(ErrorKind.ALREADY_EXISTS, "a request with this id is already running")
        return self.handoff.preallocate(request_id, prompt_token_ids, spans, lease_s)

    def _check_push(self, request_id: str, reservation_id: str, mm_hash: str, num_tokens: int) -> None:
        self.handoff.check_push(request_id, reservation_id, mm_hash, num_tokens)

    def _fill(self, request_id: str, reservation_id: str, mm_hash: str, embedding: Any) -> None:
        self.handoff.fill(request_id, reservation_id, mm_hash, embedding)

    def _add_request(self, request: Request, post: Callable[[Event], None]) -> None:
        if request.request_id in self._live:
            raise EngineError(ErrorKind.ALREADY_EXISTS, "a request with this id is already running")
        held = self.handoff.take_over(request)
        try:
            self.scheduler.add_request(request, span_refs=held)
        except QueueFull as exc:
            self.handoff.release(request, held)
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "too many waiting requests", exc.retry_after_s) from None
        except ValueError as exc:
            self.handoff.release(request, held)
            raise EngineError(ErrorKind.INVALID_ARGUMENT, str(exc)) from None
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling.stop)
        self._live[request.request_id] = _Live(request=request, detokenizer=detokenizer, post=post)

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.handoff.cancel(request_id)
        if live is not None:
            live.post(Finished(RequestStatus.FINISHED_ABORTED, request or live.request))

    def _stats(self) -> dict[str, int]:
        stats = dict(self.embedding_cache.stats())
        # READY rows that cannot be evicted are referenced by a request or pinned.
        stats["referenced_tokens"] = stats["ready_tokens"] - stats["evictable_tokens"]
        stats.update(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_total=self.scheduler.kv_cache.num_blocks,
            num_kv_blocks_used=self.scheduler.kv_cache.num_blocks - self.scheduler.kv_cache.num_free_blocks,
            num_live_requests=len(self._live),
            num_embeddings_stored=len(self._embeddings),
            num_kv_blocks_pinned=self.scheduler.kv_cache.num_pinned_blocks,
            num_kv_leases=self.handoff.num_kv_leases,
            num_steps=self.step_stats.num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            **{f"{stage}_ms": int(seconds * 1000) for stage, seconds in self.step_stats.seconds.items()},
        )
        return stats

    def _fail_all_for_shutdown(self) -> None:
        self._stopping = True
        for request_id in list(self._live):
            self._fail(request_id, EngineError(ErrorKind.UNAVAILABLE, "server is shutting down"))

    def _fail(self, request_id: str, error: EngineError) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR, error.message)
        self.handoff.cancel(request_id)
        live = self._live.pop(request_id, None)
        if live is not None:
            live.post(Failed(error))

    # ------------------------------------------------------------------
    # engine thread: the loop
    # ------------------------------------------------------------------

    def _run(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        idle = True
        while True:
            if not self._drain_inbox(timeout=self._sweep_interval if idle else 0.0):
                break
            self._maybe_sweep()
            self._has_work = self.scheduler.has_unfinished_requests()  # a step hung after idling is a stall
            idle = not self._step()
            self._has_work = self.scheduler.has_unfinished_requests()
            self.last_step_time = time.monotonic()

    def _drain_inbox(self, timeout: float) -> bool:
        """Runs queued commands; blocks up to ``timeout`` for the first. False = stop."""
        try:
            command = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            command()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self._sweep_interval
        for mm_hash in self.handoff.expire(now):
            error = EngineError(
                ErrorKind.DEADLINE_EXCEEDED, "an image embedding was not delivered before its lease expired"
            )
            for request in self.scheduler.fail_requests_waiting_on(mm_hash, error.message):
                self._fail(request.request_id, error)

    def _step(self) -> bool:
        """Runs one scheduled step; False when nothing could be scheduled."""
        if not self.scheduler.has_unfinished_requests():
            return False
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        scheduled = time.perf_counter()
        self.step_stats.seconds["schedule"] += scheduled - started
        runner_output = ModelRunnerOutput()
        if not scheduler_output.is_empty:
            try:
                runner_output = self.runner.execute(scheduler_output, self._embeddings)
                self.step_stats.seconds["execute"] += time.perf_counter() - scheduled
            except Exception:  # noqa: BLE001 - the engine keeps serving other requests
                log.exception("model step failed; failing the %d requests in the batch", len(scheduler_output.chunks))
                error = EngineError(ErrorKind.INTERNAL, "model execution failed")
                for chunk in scheduler_output.chunks:
                    self._fail(chunk.request_id, error)
                return True
        # Always report back, even for an empty step: requests the scheduler
        # failed inside schedule() (an evicted image on resume) surface here.
        executed = time.perf_counter()
        finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._emit(scheduler_output, runner_output)
        self.step_stats.seconds["update"] += time.perf_counter() - executed
        for request in finished:
            if request.status == RequestStatus.FINISHED_ERROR and request.request_id in self._live:
                kind = ErrorKind.UNAVAILABLE if request.error_retryable else ErrorKind.INTERNAL
                self._fail(request.request_id, EngineError(kind, request.error or "request failed"))
        if scheduler_output.is_empty:
            return False
        self.step_stats.record(scheduler_output, runner_output, time.perf_counter() - started)
        return True

    def _emit(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for chunk in scheduler_output.chunks:
            sampled = runner_output.sampled.get(chunk.request_id)
            live = self._live.get(chunk.request_id)
            if sampled is None or live is None:
                continue
            request = live.request
            now = time.monotonic()
            if request.timings.first_token is None:
                request.timings.first_token = now
            text, stopped = live.detokenizer.add_tokens([sampled.token_id])
            if stopped and not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            if request.is_finished and not stopped:
                text += live.detokenizer.flush()
            logprobs = [sampled] if request.sampling.logprobs is not None else []
            live.post(TokenDelta([sampled.token_id], text, logprobs))
            if request.is_finished:
                request.timings.finished = request.timings.finished or now
                del self._live[request.request_id]
                live.post(Finished(request.status, request))


def usage_of(request: Request) -> Mapping[str, float]:
    """Token counts and per-stage timings (ms) of a finished request."""
    t = request.timings
    first_scheduled = t.first_scheduled or t.arrival
    first_token = t.first_token or first_scheduled
    finished = t.finished or time.monotonic()
    return {
        "prompt_tokens": request.num_prompt_tokens,
        "completion_tokens": len(request.output_token_ids),
        "cached_tokens": request.num_cached_tokens,
        "image_tokens": request.num_image_tokens,
        "queue_ms": (first_scheduled - t.arrival) * 1000.0,
        "embedding_wait_ms": t.embedding_wait_s * 1000.0,
        "prefill_ms": max(0.0, first_token - first_scheduled) * 1000.0,
        "decode_ms": max(0.0, finished - first_token) * 1000.0,
    }

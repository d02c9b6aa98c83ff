"""The engine thread: runs an ``EngineCore`` and lets asyncio servers talk to it.

A dedicated thread loops: run the commands queued by the asyncio side, then
``core.step()``, then hand each ``RequestEvent`` to the queue of the stream
that listens for it (``loop.call_soon_threadsafe``). The core is touched only
on this thread, and CPU/GPU work never runs on the event loop. No policy
lives here: what to compute, when leases end and what a request holds are
the core's.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from services.pd.engine.core import EngineCore
from services.pd.engine.engine_stats import EngineStats
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.outputs import Allocation, Event, Failed, Finished, RequestEvent
from services.pd.engine.request import MultiModalSpan, Request

T = TypeVar("T")

log = logging.getLogger(__name__)


class EngineBridge:
    """Runs ``core`` on its own thread; the asyncio-facing methods mirror the core's."""

    def __init__(self, core: EngineCore, thread_init: Callable[[], None] | None = None) -> None:
        """``thread_init`` runs first on the engine thread (per-thread runtime settings:
        OpenMP's thread count is per thread, and oneDNN would otherwise use every core)."""
        self.core = core
        self._thread_init = thread_init
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._listeners: dict[str, Callable[[Event], None]] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="pd-engine", daemon=True)
        self._stopping = False
        # Written by the engine thread after every loop iteration, read by the
        # readiness watchdog (``stalled_for``); plain attribute writes are atomic.
        self.last_step_time = time.monotonic()
        self._has_work = False
        self._shared_stats: asyncio.Future[EngineStats] | None = None  # the read callers share
        self._loop_hooks: list[Callable[[], None]] = []  # run on the engine thread after every iteration
        self._pre_step_hooks: list[Callable[[], None]] = []  # and these before its step
        self._step_delay: Callable[[], float] | None = None  # seconds to wait before the next step

    @property
    def hidden_size(self) -> int:
        return self.core.hidden_size

    @property
    def num_deepstack_levels(self) -> int:
        return self.core.num_deepstack_levels

    # ---------------------------------------------------------------- lifecycle
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
        """Seconds the loop has made no progress while work is pending (0 = healthy or idle).

        Any thread may call it. The loop comes round at least every lease
        sweep interval even when idle or waiting for images, so only a stuck
        (or very long) step or command makes this grow.
        """
        if not self._has_work and self._inbox.empty():
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self.last_step_time)

    def add_loop_hook(self, hook: Callable[[], None], before_step: bool = False) -> None:
        """Runs ``hook()`` on the engine thread after every loop iteration (commands and a step), before
        the thread waits again, or with ``before_step`` between the commands and the step; it must be
        quick (the cache-event feed takes its batch there). Call before ``start``."""
        (self._pre_step_hooks if before_step else self._loop_hooks).append(hook)

    def set_step_delay(self, delay: Callable[[], float]) -> None:
        """Before each step the engine thread asks ``delay()`` (quick, on that thread) how long to hold
        the step; it runs the commands that arrive meanwhile and asks again. Call before ``start``."""
        self._step_delay = delay

    # ------------------------------------------------------------ asyncio side
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
            except BaseException as exc:
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
        peer: str = "",
        cache_salt: str = "",
    ) -> list[Allocation]:
        """``EngineCore.preallocate`` on the engine thread."""
        return await self.call(
            self.core.preallocate, request_id, list(spans), lease_s, list(prompt_token_ids), peer, cache_salt
        )

    async def push(self, request_id: str, reservation_id: str, mm_hash: str, embedding: Any) -> bool:
        """``EngineCore.fill`` with a received embedding (``[num_tokens, hidden]``, or ``[num_tokens, 1 + levels, hidden]``);
        False for a repeat of a push that landed."""
        return await self.call(self.core.fill, request_id, reservation_id, mm_hash, embedding)

    async def add_request(self, request: Request, kv_reservation_id: str = "") -> asyncio.Queue[Event]:
        """``EngineCore.add_request`` (``add_handed_off`` with a KV reservation); the request's events
        arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def post(event: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        def admit() -> None:
            if kv_reservation_id:
                self.core.add_handed_off(request, kv_reservation_id)
            else:
                self.core.add_request(request)
            self._listeners[request.request_id] = post

        try:
            await self.call(admit)
        except asyncio.CancelledError:
            # The caller went away while admission was queued: ``admit`` still runs on the
            # engine thread, so end the request right after it (only if it is this call's).
            def abandon() -> None:
                if self._listeners.get(request.request_id) is post:
                    self._abort(request.request_id)

            self._inbox.put(abandon)
            raise
        return events

    def abort(self, request_id: str) -> None:
        """``EngineCore.abort`` from any thread; idempotent, unknown ids are ignored."""
        if self._thread.is_alive():
            self._inbox.put(lambda: self._abort(request_id))

    async def stats(self) -> EngineStats:
        """``EngineCore.stats`` after every command queued before it (FIFO: it sees their effects)."""
        return await self.call(self.core.stats)

    async def shared_stats(self) -> EngineStats:
        """``stats`` for callers that give up after a timeout (metric scrapes, GetLoad).

        Every caller while a read is queued awaits that read instead of queuing
        its own, so callers timing out on a stuck engine leave at most one read
        behind, not one each. No ordering against other commands is promised.
        """
        shared = self._shared_stats
        # A read queued before the thread died never runs: callers then get ``stats``' own refusal.
        if shared is None or shared.done() or not self._thread.is_alive():
            shared = self._shared_stats = asyncio.ensure_future(self.stats())
            shared.add_done_callback(_retrieve)  # its failure is the awaiting callers' to see
        return await asyncio.shield(shared)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            # The liveness check sees a dead thread (services/pd/watchdog.py); say why first.
            log.exception("the engine thread died")
            raise

    def _loop(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        idle = True
        while True:
            if not self._drain_inbox(timeout=self.core.sweep_interval_s if idle else 0.0):
                break
            self._has_work = self.core.has_work()  # a step hung after idling is a stall
            self._run_hooks(self._pre_step_hooks)
            if self._step_delay is not None and (delay := self._step_delay()) > 0:
                # A command (an image, a prompt) ends the hold early; leases end on time meanwhile.
                if not self._drain_inbox(timeout=min(delay, self.core.sweep_interval_s)):
                    break
                self._dispatch(self.core.sweep_without_step())
                self.last_step_time = time.monotonic()  # the loop goes round: no stall
                idle = False  # then ask again at once
                continue
            result = self.core.step()
            self._dispatch(result.events)
            self._run_hooks(self._loop_hooks)
            idle = not result.executed
            self._has_work = self.core.has_work()
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

    @staticmethod
    def _run_hooks(hooks: list[Callable[[], None]]) -> None:
        for hook in hooks:
            try:
                hook()
            except Exception:  # a hook must never end the loop
                log.exception("an engine-loop hook failed")

    def _abort(self, request_id: str) -> None:
        # Nobody awaits an abort: a failure in it is logged here, never allowed to end the loop.
        try:
            self.core.abort(request_id)
        except Exception:
            log.exception("abort of a request failed")

    def _dispatch(self, events: list[RequestEvent]) -> None:
        for request_id, event in events:
            terminal = isinstance(event, (Finished, Failed))
            post = self._listeners.pop(request_id, None) if terminal else self._listeners.get(request_id)
            if post is not None:
                post(event)

    def _fail_all_for_shutdown(self) -> None:
        self._stopping = True
        self.core.fail_all(EngineError(ErrorKind.UNAVAILABLE, "server is shutting down"))
        self._dispatch(self.core.step().events)


def _retrieve(future: asyncio.Future) -> None:
    """Marks a shared read's exception as seen: every caller may have timed out already."""
    if not future.cancelled():
        future.exception()

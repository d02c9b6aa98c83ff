"""HTTP plumbing on the way out: bounded response writes and the SSE response.

The SSE response pulls its first event *before* sending the status line,
so admission failures (503 + Retry-After, 504, 400 from PD) still reach the
client as proper HTTP errors; only failures after the first event become
in-stream error events. A watcher listens for the client going away for the
whole life of the response and cancels the generation when it does.

Every response write must be taken by the client within ``WriteBound`` (a
client that stopped reading blocks the server's ``send`` under TCP flow
control, or leaves a whole body in the server's buffer); a stalled write
drops the response, which closes the generation behind it, and resets the
connection so that nothing stays buffered for that client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from services.proxy.web.http_util import as_api_error, error_response, wait_disconnect

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


WRITE_GRACE_S = 1.0
"""A write that starts near or after the deadline still gets this long (a last chunk, ``[DONE]``)."""


class WriteStalled(Exception):
    """The client did not take a response write within its ``WriteBound``."""


@dataclass(frozen=True)
class WriteBound:
    """How long each response write may wait for the client to read.

    A write must complete by the request's ``deadline`` (``time.monotonic()``),
    or within ``WRITE_GRACE_S`` when it starts later than that allows, and
    within ``stall_s`` in any case (0 = no such bound). ``on_stall`` runs
    once when a write does not (the caller counts it).
    """

    deadline: float
    stall_s: float = 0.0
    on_stall: Callable[[], None] = lambda: None

    def limit_s(self, now: float) -> float:
        """Seconds a write that starts at ``now`` may take."""
        limit = max(self.deadline - now, WRITE_GRACE_S)
        return min(limit, self.stall_s) if self.stall_s > 0 else limit

    def wrap(self, send: Send) -> Send:
        """``send`` whose every call raises ``WriteStalled`` when it cannot complete in time."""

        async def bounded_send(message: Message) -> None:
            limit_s = self.limit_s(time.monotonic())
            try:
                async with asyncio.timeout(limit_s):
                    await send(message)
            except TimeoutError:
                self.on_stall()
                log.warning("a client took no response write for %.1f s; the response is dropped", limit_s)
                raise WriteStalled() from None

        return bounded_send


def _transport(receive: Receive) -> Any:
    """The connection's asyncio transport, where the server exposes it (else None).

    ASGI has no way to reach the connection; uvicorn hands the app a
    ``receive`` bound to the connection's request cycle, which holds it.
    """
    return getattr(getattr(receive, "__self__", None), "transport", None)


def drop_connection(receive: Receive) -> bool:
    """Resets the client's connection now, discarding what was not sent; False where the server does not allow it.

    After a stalled write the server holds bytes a client that stopped reading
    never takes, so closing the connection politely (flush, then close) would
    keep it open for as long as the client does.
    """
    transport = _transport(receive)
    abort = getattr(transport, "abort", None)
    if not callable(abort):
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:  # linger 0: the kernel sends a reset and frees its buffers too, not just the proxy
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    abort()
    return True


_FLUSH_POLL_S = 0.02


async def wait_flushed(receive: Receive, bound: WriteBound) -> None:
    """Returns once the server has handed every response byte to the kernel; ``WriteStalled`` past ``bound``.

    A server's ``send`` of a whole body returns as soon as the bytes are
    buffered, so without this a client that never reads would keep them in
    the proxy for as long as it keeps the connection open.
    """
    transport = _transport(receive)
    size = getattr(transport, "get_write_buffer_size", None)
    if not callable(size) or not size():
        return
    limit_s = bound.limit_s(time.monotonic())
    try:
        async with asyncio.timeout(limit_s):
            while size() and not transport.is_closing():
                await asyncio.sleep(_FLUSH_POLL_S)
    except TimeoutError:
        bound.on_stall()
        log.warning("a client took no response bytes for %.1f s; the response is dropped", limit_s)
        raise WriteStalled() from None


class BoundedJSONResponse(JSONResponse):
    """A JSON response whose write is bounded (``WriteBound``); a stalled client gets nothing more."""

    def __init__(self, content: Any, *, bound: WriteBound, headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers=headers)
        self.bound = bound

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, self.bound.wrap(send))
            await wait_flushed(receive, self.bound)
        except WriteStalled:
            drop_connection(receive)


class EventStreamResponse(Response):
    """``text/event-stream`` response whose status is decided by its first event.

    Every write is bounded by ``bound``: when the client stops reading, the
    response is dropped and the event generator closed (which aborts the
    generation behind it) instead of waiting on TCP flow control forever.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        headers: dict[str, str] | None = None,
        *,
        bound: WriteBound | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.bound = bound
        self.on_close = on_close  # called once the response ends, however it ends (releases held allowances)
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._serve(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.bound is not None:
            send = self.bound.wrap(send)
        async with anyio.create_task_group() as group:

            async def respond() -> None:
                try:
                    await self._respond(scope, receive, send)
                except WriteStalled:  # leaving _respond closed the events (the generation is aborted)
                    drop_connection(receive)
                group.cancel_scope.cancel()

            group.start_soon(respond)
            await wait_disconnect(receive)
            # Cancelling the scope unwinds the event generator, which cancels
            # the PD stream and Encode calls and schedules the PD Abort.
            group.cancel_scope.cancel()

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.events):
            try:
                first = await anext(self.events)
            except StopAsyncIteration:
                first = b""
            except Exception as error:  # nothing sent yet: a real HTTP status is still possible
                await error_response(as_api_error(error))(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

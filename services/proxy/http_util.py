"""HTTP plumbing: bounded body reading, disconnect watching, bounded writes, the SSE response.

The SSE response pulls its first event *before* sending the status line,
so admission failures (503 + Retry-After, 504, 400 from PD) still reach the
client as proper HTTP errors; only failures after the first event become
in-stream error events. A watcher listens for the client going away for the
whole life of the response and cancels the generation when it does.

Slow clients are bounded both ways: the body must arrive within its time
limit (408), and every response write must be taken by the client within
``WriteBound`` (a client that stopped reading blocks the server's ``send``
under TCP flow control, or leaves a whole body in the server's buffer); a
stalled write drops the response, which closes the generation behind it,
and resets the connection so that nothing stays buffered for that client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import struct
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from services.proxy.errors import (
    ApiError,
    InvalidTimeoutError,
    RequestError,
    body_timeout,
    body_too_large,
    internal_error,
    unsupported_media_type,
)
from services.proxy.schemas import FIELD_NAMES

log = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.response_headers())


def as_api_error(error: BaseException) -> ApiError:
    """Any exception -> the ApiError the client sees (unexpected ones become a bare 500)."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestError):
        return error.to_api_error()
    log.error("unexpected error", exc_info=error)
    return internal_error()


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes and (408) anything slower than ``timeout_s``.

    Content-Length is checked first; the running total is checked while
    reading too, since a chunked body has no length. The 408 asks the
    server to close the connection (the rest of the body is never read).
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "Invalid Content-Length header.", "invalid_request_error", "invalid_request")
        if int(declared) > limit:
            raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(max(timeout_s, 0.0)):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise body_too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise body_timeout() from None
    return b"".join(chunks)


def check_json_content_type(request: Request) -> None:
    """Refuses (415) a body not declared as JSON.

    A browser sends ``application/x-www-form-urlencoded`` or ``text/plain``
    bodies cross-site without a CORS preflight; only ``application/json``
    (parameters such as ``charset`` allowed) needs one, so only it is read.
    """
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise unsupported_media_type()


# Pydantic error types whose message is built from the schema only (limits,
# expected types, allowed literals, JSON syntax positions), never from the input.
# Others (e.g. ``union_tag_invalid``, which quotes the tag sent) get a generic message.
_SAFE_MESSAGE_TYPES = frozenset(
    {
        "missing",
        "json_invalid",
        "json_type",
        "model_type",
        "model_attributes_type",
        "dict_type",
        "list_type",
        "string_type",
        "int_type",
        "float_type",
        "bool_type",
        "int_from_float",
        "finite_number",
        "literal_error",
        "greater_than",
        "greater_than_equal",
        "less_than",
        "less_than_equal",
        "too_short",
        "too_long",
        "string_too_short",
        "string_too_long",
        "union_tag_not_found",
        "none_required",
    }
)


def describe_validation_error(errors: list) -> tuple[str, str | None]:
    """``(message, param)`` of the first validation error, built without any client input.

    Location parts are kept only when they are indexes or schema field names
    (a dict key the client chose is dropped).
    """
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    parts = [str(p) for p in first.get("loc", ()) if isinstance(p, int) or p in FIELD_NAMES]
    location = ".".join(parts)
    detail = str(first.get("msg", "")) if first.get("type") in _SAFE_MESSAGE_TYPES else "Invalid value."
    return (f"{location}: {detail}" if location else detail), (location or None)


PARTS_PER_MESSAGE = 16
"""Content parts a chat message may have on average (``check_message_count``)."""


def check_message_count(raw: bytes, max_messages: int) -> None:
    """400 when a chat body has more than ``max_messages`` messages or ``PARTS_PER_MESSAGE`` times as many
    content parts, counted in the raw bytes before parsing (the parse's cost grows with them).

    In JSON a quote inside a string is escaped, so the bytes ``"role"`` and ``"type"`` occur only as keys
    or as a whole string value: their counts bound the messages and the content parts from above (a value
    that is exactly "role" or "type" counts too, which a body near the limit could notice).
    """
    if raw.count(b'"role"') > max_messages or raw.count(b'"type"') > PARTS_PER_MESSAGE * max_messages:
        raise RequestError(
            f"The request has more than {max_messages} messages (or {PARTS_PER_MESSAGE * max_messages} content "
            "parts); send fewer.",
            "messages",
        )


def parse_body(raw: bytes, model: type[ModelT]) -> ModelT:
    """Validates JSON against ``model``; errors become a 400 naming the field, never the value."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        message, param = describe_validation_error(error.errors(include_url=False, include_input=False))
        raise RequestError(message, param) from None


TIMEOUT_HEADER = "x-request-timeout"


def request_timeout(request: Request, default_s: float) -> float:
    """The request's end-to-end timeout: ``X-Request-Timeout`` seconds, capped by ``default_s``.

    The header may only shorten the server's own limit; anything but a
    positive finite number is a 400.
    """
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return default_s
    try:
        value = float(raw.strip())
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise InvalidTimeoutError("X-Request-Timeout must be a positive number of seconds.", "X-Request-Timeout")
    return min(value, default_s)


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the ASGI server reports ``http.disconnect`` (call after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs ``work``; cancels it and raises ``ClientDisconnected`` if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()


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

"""HTTP plumbing: bounded body reading, disconnect watching, the SSE response.

The SSE response pulls its first event *before* sending the status line,
so admission failures (503 + Retry-After, 504, 400 from PD) still reach the
client as proper HTTP errors; only failures after the first event become
in-stream error events. A watcher listens for the client going away for the
whole life of the response and cancels the generation when it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from services.proxy.errors import ApiError, RequestError, body_too_large, internal_error

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


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes.

    Content-Length is checked first; the running total is checked while
    reading too, since a chunked body has no length.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "Invalid Content-Length header.", "invalid_request_error", "invalid_request")
        if int(declared) > limit:
            raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes, model: type[ModelT]) -> ModelT:
    """Validates JSON against ``model``; errors become a 400 naming the field, never the value."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors(include_url=False, include_input=False)[0]
        location = ".".join(str(part) for part in first["loc"])
        message = f"{location}: {first['msg']}" if location else str(first["msg"])
        raise RequestError(message, location or None) from None


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


class EventStreamResponse(Response):
    """``text/event-stream`` response whose status is decided by its first event."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def respond() -> None:
                await self._respond(scope, receive, send)
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


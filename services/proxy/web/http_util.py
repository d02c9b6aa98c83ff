"""HTTP plumbing on the way in: bounded body reading, body checks and parsing, disconnect watching.

Slow clients are bounded: the body must arrive within its time limit
(408). Bounded response writes and the SSE response live in
``services.proxy.web.bounded_responses``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive

from services.proxy.errors import (
    ApiError,
    InvalidTimeoutError,
    RequestError,
    body_timeout,
    body_too_large,
    internal_error,
    unsupported_media_type,
)
from services.proxy.openai.schemas import FIELD_NAMES

log = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")


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

"""Cross-cutting HTTP concerns: API key, request metrics, access log, OpenAI-shaped errors for everything."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.logs import AccessLine, safe_request_id
from services.proxy.errors import ApiError, RequestError, error_body, invalid_api_key
from services.proxy.metrics import ProxyMetrics
from services.proxy.trace import new_request_id
from services.proxy.web.http_util import as_api_error, describe_validation_error, error_response

log = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_LOGGED_ROUTES = GENERATION_PATHS | {"/v1/models"}
_UNLOGGED_PATHS = frozenset({"/health", "/health/live", "/metrics"})  # probes and scrapes: no access lines
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
ACCESS_LINE = "epd_access_line"
"""Key of the request's ``AccessLine`` in ``scope["state"]``; read it with ``access_line(request)``."""


def access_line(request: Request) -> AccessLine | None:
    """The access line of ``request`` (None when the app runs without ``AccessLogMiddleware``)."""
    return request.scope.get("state", {}).get(ACCESS_LINE)


class AccessLogMiddleware:
    """One access line per HTTP request (``/health`` and ``/metrics`` excepted), and an ``X-Request-Id`` header.

    Handlers add fields through ``access_line(request)``; the generation
    handlers set ``request_id`` (the OpenAI response id, which also travels
    to every backend in gRPC metadata). A request refused before that gets
    a fresh ``req-`` id. A client's own ``X-Request-Id`` is logged as
    ``client_request_id`` when it is a plain id (``safe_request_id``) and
    dropped otherwise; it never reaches a backend, so clients cannot make
    ids collide there. Unknown paths are logged as route ``other``, not echoed.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in _UNLOGGED_PATHS:
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "")
        client_id = next((value for name, value in scope.get("headers", ()) if name == b"x-request-id"), None)
        line = AccessLine(
            log,
            "http",
            request_id=None,
            client_request_id=safe_request_id(client_id),
            method=method if method in _METHODS else "other",
            route=path if path in _LOGGED_ROUTES else "other",
            status=None,
        )
        scope.setdefault("state", {})[ACCESS_LINE] = line

        async def send_and_watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                request_id = line.fields["request_id"] or new_request_id("req")
                line.update(status=message["status"], request_id=request_id)
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except asyncio.CancelledError:
            if line.fields["status"] is None:
                line.update(status=499)  # the client went away before any answer
            raise
        except Exception:
            if line.fields["status"] is None:
                line.update(status=500)  # answered 500 by the outermost error handler
            raise
        finally:
            if line.fields["request_id"] is None:
                line.update(request_id=new_request_id("req"))
            line.write()


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on ``/v1/*`` (``/health`` and ``/metrics``: ``InternalsGuard``).

    Runs before the body is read, so an unauthenticated client costs
    nothing; the comparison takes constant time.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            given = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self._expected):
                await error_response(invalid_api_key())(scope, receive, send)
                return
        await self.app(scope, receive, send)


class InternalsGuard:
    """Who may see backend addresses (``/health`` details) and ``/metrics`` on the public port.

    Open when neither ``--api-key`` nor ``--metrics-require-token`` is set;
    otherwise only a caller sending ``Authorization: Bearer <API key>`` (none
    at all without a key). The internal token opens nothing here: it is for
    calls between the services, and a scraper holding it uses the proxy's
    ``--metrics-port``. Compared in constant time.
    """

    def __init__(self, api_key: str | None, *, require_token: bool) -> None:
        self.protected = api_key is not None or require_token
        self._expected = None if api_key is None else b"Bearer " + api_key.encode()

    def allows(self, request: Request) -> bool:
        if not self.protected:
            return True
        if self._expected is None:
            return False
        given = request.headers.get("authorization", "").encode("latin-1", "replace")
        return hmac.compare_digest(given, self._expected)


class MetricsMiddleware:
    """Counts requests by status and times successful ones, streams included (pure ASGI)."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        started, status = time.monotonic(), 500
        self.metrics.in_flight.labels(path).inc()

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            self.metrics.in_flight.labels(path).dec()
            self.metrics.requests.labels(path, str(status)).inc()
            if status < 400:
                self.metrics.duration.labels(path).observe(time.monotonic() - started)


def install_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, leaves as an OpenAI error body that names no input."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        # ApiError, RequestError, and anything unexpected (a bare 500 that names nothing).
        return error_response(as_api_error(exc))

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        errors = list(exc.errors()) if isinstance(exc, RequestValidationError) else []
        message, param = describe_validation_error(errors)
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_request"), 400)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
        error_type = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(error_body(str(getattr(exc, "detail", "")) or "Error.", error_type), status)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_api_error)

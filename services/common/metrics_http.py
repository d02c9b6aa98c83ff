"""Prometheus helpers shared by the gRPC services: the ``/metrics`` HTTP endpoint and metric docs.

Each encoder and PD serves ``GET /metrics`` on its own port (``--metrics-port``;
0 = a free port, -1 = off) from a tiny HTTP/1.1 server on the service's own
event loop. Running on the loop, not in a thread, lets a scrape ``await``
a consistent snapshot (PD reads its engine between two steps). Each
connection answers one request and closes; request heads are bounded in
size and time, and nothing from the request is echoed back. With a token
(``--metrics-require-token``) a request without ``Authorization: Bearer
<token>`` gets 401; the comparison takes constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
"""Longest request line + headers accepted (a scraper sends a few hundred bytes)."""
HEAD_TIMEOUT_S = 10.0
"""How long a connection may take to send its request head."""


class MetricDoc(NamedTuple):
    """One exported metric, as the README documents it."""

    name: str  # exposed name (counters end in _total; histograms add _bucket/_sum/_count)
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    meaning: str


Render = Callable[[], Awaitable[bytes]]
"""Produces the exposition text (Prometheus text format) for one scrape."""


class MetricsHttpServer:
    """``GET /metrics`` on ``host:port``; anything else answers 404 or 405."""

    def __init__(self, render: Render, head_timeout_s: float, token: str | None = None) -> None:
        self._render = render
        self._head_timeout_s = head_timeout_s
        self._expected = None if token is None else b"Bearer " + token.encode()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    @classmethod
    async def start(
        cls,
        host: str,
        port: int,
        render: Render,
        *,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        token: str | None = None,
    ) -> MetricsHttpServer:
        """Binds ``host:port`` (0 = a free port); raises OSError when it cannot.

        ``token``: scrapes must send ``Authorization: Bearer <token>`` (None = open).
        """
        self = cls(render, head_timeout_s, token)
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self

    @property
    def port(self) -> int:
        """The bound port."""
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stops listening and ends open connections."""
        assert self._server is not None
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            status, body = await self._answer(reader)
            content_type = CONTENT_TYPE_LATEST if status == 200 else "text/plain; charset=utf-8"
            challenge = "WWW-Authenticate: Bearer\r\n" if status == 401 else ""
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n{challenge}"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("ascii") + body)
            await writer.drain()
        except ConnectionError:
            pass  # the scraper went away
        finally:
            writer.close()
            if task is not None:
                self._connections.discard(task)

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._head_timeout_s)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError):
            return 400, b"bad request\n"
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, b"bad request\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if target != b"/metrics":
            return 404, b"not found; metrics are at /metrics\n"
        if method != b"GET":
            return 405, b"only GET\n"
        if not self._authorized(head):
            return 401, b"the internal token is required\n"
        try:
            return 200, await self._render()
        except Exception:
            log.exception("rendering metrics failed")
            return 500, b"rendering metrics failed\n"

    def _authorized(self, head: bytes) -> bool:
        if self._expected is None:
            return True
        ok = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization":
                ok |= hmac.compare_digest(value.strip(), self._expected)
        return ok


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
}

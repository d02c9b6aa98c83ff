"""Logging shared by every process: one line per event, optionally JSON, and per-request access lines.

Access lines (``log_request`` / ``AccessLine``) carry their fields twice:
as ``key=value`` pairs in the message (text mode) and as record attributes,
which the JSON formatter turns into top-level keys. Only counts, timings,
status names and validated ids go into them; never prompt text, image bytes
or other client-supplied strings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from types import TracebackType
from typing import Any

_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "color_message",  # the last one: uvicorn's coloured copy of its message
}
"""Attributes that are not ``extra`` fields: every ``LogRecord`` has them."""

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
"""What a request id may look like when it came from outside: short, no spaces or control characters."""

_PLAIN_VALUE_RE = re.compile(r"[A-Za-z0-9._:/+@-]+")


def safe_request_id(value: object) -> str | None:
    """``value`` when it is a plain request id (1..128 of ``[A-Za-z0-9._:/-]``), else None.

    For ids received from a peer (gRPC metadata) or a client (``X-Request-Id``):
    anything else is dropped rather than logged.
    """
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and _REQUEST_ID_RE.fullmatch(value):
        return value
    return None


def _text_value(value: Any) -> str:
    """One value of a ``key=value`` line; anything with spaces, quotes or control characters is JSON-quoted."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.1f}"
    text = str(value)
    return text if _PLAIN_VALUE_RE.fullmatch(text) else json.dumps(text)


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return round(value, 3)
    return str(value)


def format_fields(event: str, fields: dict[str, Any]) -> str:
    """``event key=value key=value ...`` in the given field order."""
    return " ".join([event, *(f"{key}={_text_value(value)}" for key, value in fields.items())])


def log_request(logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Writes one structured line: ``event`` plus ``fields`` (key=value in text, keys in JSON).

    Field names must not clash with ``LogRecord`` attributes (``name``,
    ``msg``, ``args``, ...); ``logging`` raises KeyError for those.
    """
    if logger.isEnabledFor(level):
        logger.log(level, format_fields(event, fields), extra={"event": event, **fields})


class AccessLine:
    """One request's access line: fields filled in while the request runs, written once.

    Used as a context manager it writes on exit, adding ``duration_ms`` and,
    unless the code set one, a ``status``: ``OK`` after a normal exit,
    ``CANCELLED`` after cancellation or a closed stream, ``INTERNAL`` after
    any other exception.
    """

    def __init__(self, logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
        self.logger = logger
        self.event = event
        self.level = level
        self.fields: dict[str, Any] = dict(fields)
        self.started = time.monotonic()
        self._written = False

    def update(self, **fields: Any) -> None:
        self.fields.update(fields)

    def add(self, name: str, amount: int) -> None:
        """Adds ``amount`` to a counter field (missing = 0)."""
        self.fields[name] = (self.fields.get(name) or 0) + amount

    def mark_first_token(self) -> None:
        """Records ``ttft_ms`` (time since the line was opened) the first time it is called."""
        if self.fields.get("ttft_ms") is None:
            self.fields["ttft_ms"] = (time.monotonic() - self.started) * 1000.0

    def write(self) -> None:
        """Logs the line (once; later calls do nothing)."""
        if self._written:
            return
        self._written = True
        if self.fields.get("status") is None:
            self.fields["status"] = "OK"
        self.fields["duration_ms"] = (time.monotonic() - self.started) * 1000.0
        log_request(self.logger, self.event, level=self.level, **self.fields)

    def __enter__(self) -> AccessLine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None and self.fields.get("status") is None:
            closed = issubclass(exc_type, (asyncio.CancelledError, GeneratorExit, KeyboardInterrupt))
            self.fields["status"] = "CANCELLED" if closed else "INTERNAL"
        self.write()


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, service, logger, msg, plus every ``extra`` field as a key."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
        }
        extra = {key: value for key, value in record.__dict__.items() if key not in _RECORD_ATTRS}
        # An access line's message is its fields again; the event name is enough.
        entry["msg"] = extra["event"] if "event" in extra else record.getMessage()
        for key, value in extra.items():
            entry.setdefault(key, _json_value(value))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "info", service: str = "epd", json_format: bool = False) -> None:
    """Configures the root logger once for this process (``json_format``: one JSON object per line)."""
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(_JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # Python warnings become log lines too (one JSON object each with --log-json)
    # Library chatter (HTTP access lines, transformers warnings) stays quiet
    # unless debugging.
    if level.lower() != "debug":
        logging.getLogger("transformers").setLevel(logging.ERROR)

"""Engine-level errors, independent of the transport.

The servicer maps ``ErrorKind`` to gRPC status codes in one table
(``services/pd/convert.py``); the engine never imports grpc.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    NOT_FOUND = "not_found"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    ALREADY_EXISTS = "already_exists"
    INTERNAL = "internal"
    PERMISSION_DENIED = "permission_denied"


class EngineError(Exception):
    """A failure with a kind the caller can act on; ``message`` never echoes input."""

    def __init__(self, kind: ErrorKind, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s

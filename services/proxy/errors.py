"""Errors the proxy returns, and the one table that maps gRPC status codes to HTTP.

Two families:

- ``RequestError`` (a ``ValueError``): the client sent something we refuse.
  Always HTTP 400 unless a subclass says otherwise. Raised by validation and
  preprocessing, before any backend work.
- ``ApiError``: anything else that ends a request with an OpenAI error body
  (backend status codes, unknown model, body too large, ...).

Messages are fixed strings or built from numbers and field names only: they
never contain prompt text, image bytes or backend details that could echo
input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import grpc

MAX_MESSAGE_CHARS = 512
"""Error messages are bounded; longer ones are cut (they never carry input anyway)."""
MAX_PARAM_CHARS = 128


@dataclass
class ApiError(Exception):
    """An error that ends an HTTP request with an OpenAI error body.

    ``retry_after_s`` becomes a ``Retry-After`` header when set.
    """

    status_code: int
    message: str
    error_type: str = "server_error"
    code: str | None = None
    param: str | None = None
    retry_after_s: int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        """The OpenAI error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.error_type, self.param, self.code)

    def response_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return headers


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object with a bounded message."""
    return {
        "error": {
            "message": message[:MAX_MESSAGE_CHARS],
            "type": error_type,
            "param": None if param is None else param[:MAX_PARAM_CHARS],
            "code": code,
        }
    }


class RequestError(ValueError):
    """The client's request is invalid (HTTP 400). Subclasses name the exact cause."""

    status_code = 400
    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_api_error(self) -> ApiError:
        return ApiError(self.status_code, self.message, "invalid_request_error", self.code, self.param)


class UnsupportedFeatureError(RequestError):
    """A valid OpenAI parameter that this server does not implement (e.g. ``n > 1``)."""

    code = "unsupported_parameter"


class UnknownFieldError(RequestError):
    """A body field (top-level or nested) that neither OpenAI nor our extensions define."""

    code = "unknown_parameter"


class PromptTooLongError(RequestError):
    """Prompt plus requested completion do not fit the model's context."""

    code = "context_length_exceeded"


class PlaceholderMismatchError(RequestError):
    """The prompt's image placeholder tokens do not match the images sent.

    Happens when text contains the image token itself; accepting it would let
    text smuggle placeholder positions that no image fills.
    """

    code = "invalid_image_placeholder"


class ImageError(RequestError):
    """Base of everything wrong with one image of a request."""

    code = "invalid_image"


class InvalidImageUrlError(ImageError):
    """Not a ``data:image/...;base64,`` URL, nor an https URL this server may fetch."""

    code = "invalid_image_url"


class ImageUrlNotAllowedError(ImageError):
    """An https image URL refused by policy: host not allowed, private address, cross-host redirect."""

    code = "image_url_not_allowed"


class ImageFetchError(ImageError):
    """An allowed image URL could not be fetched (status, timeout, size cap, connection)."""

    code = "image_fetch_failed"


class InvalidBase64Error(ImageError):
    """The data URL's payload is not strict base64."""

    code = "invalid_image_base64"


class UnsupportedImageFormatError(ImageError):
    """The bytes are not a PNG, JPEG, WEBP or GIF image."""

    code = "unsupported_image_format"


class ImageTooLargeError(ImageError):
    """Width × height (from the header, before decoding) exceeds the pixel cap."""

    code = "image_too_large"


class TruncatedImageError(ImageError):
    """The image header parsed but its data is incomplete or corrupt."""

    code = "invalid_image_data"


class TooManyPixelsError(ImageError):
    """The images of one request have more pixels together than ``max_request_pixels`` (from their headers)."""

    code = "too_many_image_pixels"


class VideoError(RequestError):
    """Base of everything wrong with one video of a request (``param``: video_url or mm_processor_kwargs)."""

    code = "invalid_video"


class InvalidVideoUrlError(VideoError):
    """Not a ``data:video/...;base64,`` URL (MP4, WebM, QuickTime, Matroska), a list of image URLs, nor a
    URL this server may fetch."""

    code = "invalid_video_url"


class UnsupportedVideoFormatError(VideoError):
    """Not an MP4/QuickTime or Matroska/WebM file, or a codec that is not decoded."""

    code = "unsupported_video_format"


class VideoTooLargeError(VideoError):
    """Over ``--max-video-bytes``, ``--max-video-seconds``, ``--max-video-frames`` or the frame-size cap
    (known from the header, before decoding)."""

    code = "video_too_large"


class InvalidVideoDataError(VideoError):
    """The video's header or data is truncated or corrupt, or it has too few frames."""

    code = "invalid_video_data"


class VideoNotSupportedError(VideoError):
    """The served model takes no videos (LLaVA)."""

    code = "video_not_supported"


class TooManyImagesError(RequestError):
    """More images in one request than ``max_images_per_request``."""

    code = "too_many_images"


class InvalidTimeoutError(RequestError):
    """The ``X-Request-Timeout`` header is not a positive number of seconds."""

    code = "invalid_request_timeout"


def no_backend(kind: str) -> ApiError:
    """Nothing of ``kind`` is routable (all not ready, breakers open, or all tried)."""
    return ApiError(
        503,
        f"No {kind} instance is available; retry later.",
        "server_error",
        "backend_unavailable",
        retry_after_s=DEFAULT_RETRY_AFTER_S,
    )


def invalid_api_key() -> ApiError:
    return ApiError(
        401,
        "Invalid or missing API key.",
        "invalid_request_error",
        "invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def model_not_found(param: str = "model") -> ApiError:
    return ApiError(
        404, "The requested model does not exist on this server.", "invalid_request_error", "model_not_found", param
    )


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"Request body exceeds the limit of {limit} bytes.", "invalid_request_error", "request_too_large"
    )


def body_timeout() -> ApiError:
    """The client did not send its whole body in time; the connection is closed after the answer."""
    return ApiError(
        408,
        "The request body was not received in time.",
        "invalid_request_error",
        "request_timeout",
        headers={"Connection": "close"},
    )


def deadline_during_body() -> ApiError:
    """The request's own deadline passed while its body arrived: the 504 of any deadline, and the
    connection is closed after it (the rest of the body is never read)."""
    return ApiError(
        504,
        "The request did not finish before its deadline.",
        "server_error",
        "timeout",
        headers={"Connection": "close"},
    )


_STALL_WHAT = {"first_token": "its first token", "inter_token": "its next token"}


def stalled(kind: str, limit_s: float) -> ApiError:
    """PD produced nothing for too long (``kind``: first_token or inter_token)."""
    return ApiError(
        504, f"The model server did not send {_STALL_WHAT[kind]} within {limit_s:g} s.", "server_error", "timeout"
    )


def unsupported_media_type() -> ApiError:
    return ApiError(
        415,
        "The request body must be sent with Content-Type: application/json.",
        "invalid_request_error",
        "unsupported_media_type",
    )


# One row per gRPC status the backends use: (HTTP status, OpenAI type, code, message).
# Messages are fixed so that a backend's details (which could quote input) never
# reach the client.
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (
        400,
        "invalid_request_error",
        "invalid_request",
        "The request was rejected by the model server as invalid.",
    ),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "server_error", "overloaded", "The server is at capacity; retry later."),
    grpc.StatusCode.UNAVAILABLE: (
        503,
        "server_error",
        "backend_unavailable",
        "No backend instance is available; retry later.",
    ),
    grpc.StatusCode.DEADLINE_EXCEEDED: (
        504,
        "server_error",
        "timeout",
        "The request did not finish before its deadline.",
    ),
    grpc.StatusCode.FAILED_PRECONDITION: (
        500,
        "server_error",
        "internal_error",
        "An image embedding could not be delivered.",
    ),
    grpc.StatusCode.NOT_FOUND: (500, "server_error", "internal_error", "The model server lost track of the request."),
    grpc.StatusCode.CANCELLED: (500, "server_error", "cancelled", "The request was cancelled by a backend."),
}
_GRPC_DEFAULT = (500, "server_error", "internal_error", "The model server failed to process the request.")

DEFAULT_RETRY_AFTER_S = 1
"""``Retry-After`` for a 503 whose backend gave no hint."""


def from_grpc(code: grpc.StatusCode, retry_after_ms: int | None = None) -> ApiError:
    """Maps a backend's gRPC status to the HTTP error the client sees.

    RESOURCE_EXHAUSTED and UNAVAILABLE carry ``Retry-After`` (seconds, rounded
    up, at least 1) taken from the ``retry-after-ms`` hint when present.
    """
    status, error_type, error_code, message = _GRPC_TO_HTTP.get(code, _GRPC_DEFAULT)
    retry_after_s = None
    if status == 503:
        retry_after_s = DEFAULT_RETRY_AFTER_S if retry_after_ms is None else max(1, math.ceil(retry_after_ms / 1000))
    return ApiError(status, message, error_type, error_code, retry_after_s=retry_after_s)


# Features a model server may lack for want of an optional install: the pip extra's name (the
# ``epd-missing-extra`` trailer of its FAILED_PRECONDITION) -> (error code, message).
_MISSING_EXTRAS: dict[str, tuple[str, str]] = {
    "structured": (
        "structured_outputs_unavailable",
        "Structured outputs are not available: the model server needs the 'structured' extra "
        "(pip install 'epd-cluster[structured]').",
    ),
}


def missing_extra(extra: str) -> ApiError | None:
    """The 400 for a request the model server refused for want of the pip extra ``extra``; None for an unknown name."""
    known = _MISSING_EXTRAS.get(extra)
    if known is None:
        return None
    code, message = known
    return ApiError(400, message, "invalid_request_error", code)


def internal_error(message: str = "Internal server error.") -> ApiError:
    return ApiError(500, message, "server_error", "internal_error")

"""Strict decoding of client images (data URL payloads and fetched bytes).

Order of checks matters: each one runs before the work it protects.
The base64 alphabet is checked while decoding; the file itself is checked
and decoded by ``services.common.image_files`` (format allow-list, width ×
height from the header before a pixel is decoded, Pillow's bomb guard on, a
truncated file fails in ``load()``), whose errors become the precise 400s
here, before any encoder work is spent on the image.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image

from services.common import image_files
from services.proxy.errors import (
    ImageTooLargeError,
    InvalidBase64Error,
    InvalidImageUrlError,
    TruncatedImageError,
    UnsupportedImageFormatError,
)

_DATA_PREFIX = "data:"


def decode_data_url(url: str, max_pixels: int) -> Image.Image:
    """Decodes ``data:image/<type>;base64,<payload>`` into a loaded RGB image.

    Raises a precise ``ImageError`` subclass (HTTP 400) for every way the
    input can be wrong; never includes the input in the message.
    """
    return decode_image_bytes(_data_url_payload(url), max_pixels)


def data_url_payload(url: str) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL (strict base64); ``ImageError`` otherwise."""
    return _data_url_payload(url)


def _data_url_payload(url: str) -> bytes:
    if not url.startswith(_DATA_PREFIX):
        raise InvalidImageUrlError("Only data: URLs with base64 image payloads are supported.", "image_url")
    header, sep, payload = url[len(_DATA_PREFIX) :].partition(",")
    if not sep:
        raise InvalidImageUrlError("Malformed data URL: missing ','.", "image_url")
    params = [p.strip().lower() for p in header.split(";")]
    media_type, flags = params[0], params[1:]
    if not media_type.startswith("image/"):
        raise InvalidImageUrlError("The data URL's media type must be image/*.", "image_url")
    if "base64" not in flags:
        raise InvalidImageUrlError("The data URL must be base64-encoded (';base64,').", "image_url")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidBase64Error("The image payload is not valid base64.", "image_url") from None
    if not data:
        raise InvalidBase64Error("The image payload is empty.", "image_url")
    return data


def image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """``(width, height)`` from the header alone (same checks as decoding, no pixel decoded)."""
    with _as_api_errors():
        return image_files.image_size(data, max_pixels)


def decode_image_bytes(data: bytes, max_pixels: int) -> Image.Image:
    """Opens, size-checks and fully decodes image bytes; returns an RGB image (``image_files``)."""
    with _as_api_errors():
        return image_files.decode_image_bytes(data, max_pixels)


@contextmanager
def _as_api_errors() -> Iterator[None]:
    """``image_files`` errors as the 400s they are at the API (``param``: image_url)."""
    try:
        yield
    except image_files.UnsupportedFormatError as error:
        raise UnsupportedImageFormatError(str(error), "image_url") from None
    except image_files.TooManyPixelsError as error:
        raise ImageTooLargeError(str(error), "image_url") from None
    except image_files.ImageFileError as error:
        raise TruncatedImageError(str(error), "image_url") from None

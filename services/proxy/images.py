"""Strict decoding of client images (data URL payloads and fetched bytes).

Order of checks matters: each one runs before the work it protects.
The base64 alphabet is checked while decoding; the format is sniffed from
the magic bytes against an allow-list; width × height come from the header
and are checked before a single pixel is decoded; Pillow's own decompression
bomb guard (``Image.MAX_IMAGE_PIXELS``) stays on; a truncated or corrupt
file fails in ``load()`` here, before any encoder work is spent on it.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, UnidentifiedImageError

from services.proxy.errors import (
    ImageTooLargeError,
    InvalidBase64Error,
    InvalidImageUrlError,
    TruncatedImageError,
    UnsupportedImageFormatError,
)

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""Pillow format names accepted; animated GIF/WEBP use their first frame."""

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


def pixel_limit(max_pixels: int) -> int:
    """The stricter of our cap and Pillow's own bomb guard (which is never switched off)."""
    guard = Image.MAX_IMAGE_PIXELS
    return min(max_pixels, guard) if guard else max_pixels


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Opens image bytes lazily (header only) and checks width × height; nothing is decoded yet."""
    max_pixels = pixel_limit(max_pixels)
    try:
        # ``formats`` restricts the plugins Pillow may try, so a TIFF, PSD,
        # SVG-ish or any other parser never sees client bytes.
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # the warning, when warnings are errors
        raise ImageTooLargeError("The image has too many pixels.", "image_url") from None
    except UnidentifiedImageError:
        raise UnsupportedImageFormatError("The image is not a PNG, JPEG, WEBP or GIF file.", "image_url") from None
    except (OSError, SyntaxError, ValueError, EOFError):
        raise TruncatedImageError("The image header is corrupt.", "image_url") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        image.close()
        raise TruncatedImageError("The image has no pixels.", "image_url")
    if width * height > max_pixels:
        image.close()
        raise ImageTooLargeError(f"The image has {width * height} pixels; the limit is {max_pixels}.", "image_url")
    return image


def image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """``(width, height)`` from the header alone (same checks as decoding, no pixel decoded)."""
    with _open(data, max_pixels) as image:
        return image.size


def decode_image_bytes(data: bytes, max_pixels: int) -> Image.Image:
    """Opens, size-checks and fully decodes image bytes; returns an RGB image.

    An RGB file is returned as decoded, without the copy ``convert`` would
    make; any other mode is converted and its decoded original dropped at
    once, so one full-size buffer is held, not two.
    """
    image = _open(data, max_pixels)
    try:
        image.seek(0)  # first frame of an animation
        image.load()
        if image.mode == "RGB":
            return image
        # convert() allocates the RGB copy; still inside the try because
        # a lazily-decoded plugin may read more data here.
        with image:
            return image.convert("RGB")
    except Image.DecompressionBombError:
        image.close()
        raise ImageTooLargeError("The image has too many pixels.", "image_url") from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError):
        image.close()
        raise TruncatedImageError("The image data is truncated or corrupt.", "image_url") from None

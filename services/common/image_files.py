"""Strict decoding of image files: the proxy's client images and the encoder's ``EncodeItem.image_file``.

Order of checks matters: each one runs before the work it protects. The
format is sniffed from the magic bytes against an allow-list; width x height
come from the header and are checked before a single pixel is decoded;
Pillow's own decompression bomb guard (``Image.MAX_IMAGE_PIXELS``) stays on;
a truncated or corrupt file fails in ``load()``. Messages never include the
input.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image, UnidentifiedImageError

MAX_FILE_BYTES = 32 << 20
"""Largest image file a vision side is sent by default: the proxy's default ``--max-body-mb``
(32), which bounds every file it forwards (a data URL's file is smaller than its body)."""

ENCODE_ENVELOPE_BYTES = 1 << 20
"""What an Encode call carries besides one image file (ids, address, grid), with room to spare."""

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""Pillow format names accepted; animated GIF/WEBP use their first frame."""


class ImageFileError(ValueError):
    """Bytes that are not an image this project decodes."""


class UnsupportedFormatError(ImageFileError):
    """Not a PNG, JPEG, WEBP or GIF file."""


class TooManyPixelsError(ImageFileError):
    """Width x height over the cap (read from the header, before decoding)."""


class CorruptImageError(ImageFileError):
    """The header or the data is truncated or corrupt."""


def pixel_limit(max_pixels: int) -> int:
    """The stricter of our cap and Pillow's own bomb guard (which is never switched off)."""
    guard = Image.MAX_IMAGE_PIXELS
    return min(max_pixels, guard) if guard else max_pixels


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Opens image bytes lazily (header only) and checks width x height; nothing is decoded yet."""
    max_pixels = pixel_limit(max_pixels)
    try:
        # ``formats`` restricts the plugins Pillow may try, so a TIFF, PSD,
        # SVG-ish or any other parser never sees these bytes.
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # the warning, when warnings are errors
        raise TooManyPixelsError("The image has too many pixels.") from None
    except UnidentifiedImageError:
        raise UnsupportedFormatError("The image is not a PNG, JPEG, WEBP or GIF file.") from None
    except (OSError, SyntaxError, ValueError, EOFError):
        raise CorruptImageError("The image header is corrupt.") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        image.close()
        raise CorruptImageError("The image has no pixels.")
    if width * height > max_pixels:
        image.close()
        raise TooManyPixelsError(f"The image has {width * height} pixels; the limit is {max_pixels}.")
    return image


def image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """``(width, height)`` from the header alone (same checks as decoding, no pixel decoded)."""
    with open_image(data, max_pixels) as image:
        return image.size


def decode_image_bytes(data: bytes, max_pixels: int) -> Image.Image:
    """Opens, size-checks and fully decodes image bytes; returns an RGB image.

    An RGB file is returned as decoded, without the copy ``convert`` would
    make; any other mode is converted and its decoded original dropped at
    once, so one full-size buffer is held, not two.
    """
    image = open_image(data, max_pixels)
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
        raise TooManyPixelsError("The image has too many pixels.") from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError):
        image.close()
        raise CorruptImageError("The image data is truncated or corrupt.") from None


@contextmanager
def decoded(data: bytes, max_pixels: int) -> Iterator[Image.Image]:
    """``decode_image_bytes`` whose pixels are freed when the block ends."""
    image = decode_image_bytes(data, max_pixels)
    try:
        yield image
    finally:
        image.close()

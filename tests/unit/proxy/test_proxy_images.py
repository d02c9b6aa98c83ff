"""Strict image decoding: every bad input is a precise RequestError subtype (HTTP 400)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from services.proxy.errors import (
    ImageTooLargeError,
    InvalidBase64Error,
    InvalidImageUrlError,
    RequestError,
    TruncatedImageError,
    UnsupportedImageFormatError,
)
from services.proxy.prompt.images import decode_data_url

MAX_PIXELS = 64 * 64


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def gradient(width: int = 24, height: int = 16) -> Image.Image:
    image = Image.new("RGB", (width, height))
    image.putdata([(x * 10 % 256, y * 15 % 256, (x + y) % 256) for y in range(height) for x in range(width)])
    return image


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_allowed_formats_decode_to_rgb(fmt):
    image = decode_data_url(data_url(encode(gradient(), fmt)), MAX_PIXELS)
    assert image.mode == "RGB"
    assert image.size == (24, 16)


def test_animated_gif_uses_first_frame():
    frames = [Image.new("RGB", (8, 8), color) for color in [(255, 0, 0), (0, 0, 255)]]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    image = decode_data_url(data_url(buffer.getvalue(), "image/gif"), MAX_PIXELS)
    assert image.getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/cat.png",
        "data:image/png,notbase64marker",
        "data:text/plain;base64,aGVsbG8=",
        "data:image/png;base64",
    ],
)
def test_rejects_non_data_or_malformed_urls(url):
    with pytest.raises(InvalidImageUrlError):
        decode_data_url(url, MAX_PIXELS)


@pytest.mark.parametrize("payload", ["not base64!!", "aGVsbG8", "aGVs\nbG8=", ""])
def test_rejects_bad_base64(payload):
    with pytest.raises(InvalidBase64Error):
        decode_data_url(f"data:image/png;base64,{payload}", MAX_PIXELS)


def test_rejects_non_image_bytes():
    with pytest.raises(UnsupportedImageFormatError):
        decode_data_url(data_url(b"%PDF-1.4 definitely not an image" * 4), MAX_PIXELS)


def test_rejects_formats_outside_the_allow_list():
    with pytest.raises(UnsupportedImageFormatError):
        decode_data_url(data_url(encode(gradient(), "BMP"), "image/bmp"), MAX_PIXELS)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_rejects_truncated_image(fmt):
    data = encode(gradient(48, 48), fmt)
    with pytest.raises(TruncatedImageError):
        decode_data_url(data_url(data[: len(data) // 2]), 48 * 48)


def test_pixel_cap_is_checked_from_the_header():
    # A 3000x3000 PNG of one colour compresses to a few KiB: the cap must
    # refuse it from the header, before decoding 9M pixels.
    data = encode(Image.new("L", (3000, 3000)), "PNG")
    assert len(data) < 100_000
    with pytest.raises(ImageTooLargeError):
        decode_data_url(data_url(data), 1000 * 1000)


def test_errors_are_request_errors_without_input():
    secret = "c2VjcmV0LXByb21wdA"  # not valid base64 (bad padding)
    with pytest.raises(RequestError) as caught:
        decode_data_url(f"data:image/png;base64,{secret}", MAX_PIXELS)
    assert secret not in str(caught.value)
    assert caught.value.to_api_error().status_code == 400


def png_claiming(width: int, height: int) -> bytes:
    """A few hundred bytes whose PNG header claims ``width`` x ``height`` pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("side", [50_000, 12_000])  # over Pillow's hard limit / only over its warning limit
def test_decompression_bombs_are_refused_even_with_a_lax_cap(side):
    # Our cap set absurdly high: Pillow's own guard (never disabled) still bounds it.
    assert Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageTooLargeError):
        decode_data_url(data_url(png_claiming(side, side)), max_pixels=10**12)

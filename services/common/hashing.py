"""Content hashing of images (``mm_hash``).

The hash covers the decoded pixels, the image-processor settings and the
model id, so the same picture re-encoded as PNG or JPEG-lossless hashes the
same, while a different processor configuration or model never shares an
embedding. Clients cannot supply a hash: the proxy always computes it, and
an encoder given the image file computes it again and refuses a mismatch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image


def _canonical(settings: Mapping[str, Any]) -> bytes:
    return json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str).encode()


STRIP_BYTES = 1 << 20
"""Pixels are hashed a strip of rows at a time: a full ``tobytes()`` copy of a 16-megapixel image is 48 MiB."""


def hash_settings(processor_settings: Mapping[str, Any], grid: Sequence[int] | None) -> Mapping[str, Any]:
    """What ``mm_hash`` covers besides the pixels: the processor settings, and the patch grid where there is
    one (it follows from pixels + settings; hashing it too keeps the hash honest should the resize rule change)."""
    return processor_settings if grid is None else {**processor_settings, "grid": list(grid)}


def mm_hash(image: Image.Image, processor_settings: Mapping[str, Any], model_id: str) -> str:
    """SHA-256 hex digest of an image's RGB pixels, size, processor settings and model id.

    The pixels go in as row-major RGB bytes, fed in strips of at most
    ``STRIP_BYTES`` (the same digest as one ``tobytes()``, without its copy).
    """
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = hashlib.sha256()
    digest.update(b"epd-mm-v1\0")
    digest.update(model_id.encode())
    digest.update(b"\0")
    digest.update(_canonical(processor_settings))
    digest.update(b"\0")
    digest.update(f"{rgb.width}x{rgb.height}".encode())
    digest.update(b"\0")
    rows = max(1, STRIP_BYTES // (3 * rgb.width))
    for top in range(0, rgb.height, rows):
        digest.update(rgb.crop((0, top, rgb.width, min(rgb.height, top + rows))).tobytes())
    return digest.hexdigest()

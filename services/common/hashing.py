"""Content hashing of images and videos (``mm_hash``).

The hash covers the decoded pixels, the image-processor settings and the
model id, so the same picture re-encoded as PNG or JPEG-lossless hashes the
same, while a different processor configuration or model never shares an
embedding. Clients cannot supply a hash: the proxy always computes it, and
an encoder given the image file computes it again and refuses a mismatch.

A tenant's cache salt (``cache_salt``: a 64-hex digest the proxy derives,
``PreallocateRequest.cache_salt``) goes into the hash too, under a domain
tag of its own: the same picture sent by two tenants gets two hashes, so
neither the encoder's cache and single flight nor PD's embedding and prefix
caches can tell one tenant that the other sent it. No salt gives the
unsalted hash of before.

A video's hash (``video_hash``) covers its sampled frames in order, the
sampling and the grid, under a tag of its own: a video never shares an
entry with an image, nor with the same file sampled otherwise.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image


def _canonical(settings: Mapping[str, Any]) -> bytes:
    return json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str).encode()


STRIP_BYTES = 1 << 20
"""Pixels are hashed a strip of rows at a time: a full ``tobytes()`` copy of a 16-megapixel image is 48 MiB."""


CACHE_SALT_RE = re.compile(r"[0-9a-f]{64}")
"""A cache salt on the wire: a SHA-256 hex digest (the salt a client chose never leaves the proxy)."""


def check_cache_salt(cache_salt: str) -> str:
    """``cache_salt`` if it is ``""`` or 64 lowercase hex characters; ValueError (naming no value) otherwise."""
    if cache_salt and not CACHE_SALT_RE.fullmatch(cache_salt):
        raise ValueError("cache_salt must be empty or 64 lowercase hex characters")
    return cache_salt


def hash_settings(processor_settings: Mapping[str, Any], grid: Sequence[int] | None) -> Mapping[str, Any]:
    """What ``mm_hash`` covers besides the pixels: the processor settings, and the patch grid where there is
    one (it follows from pixels + settings; hashing it too keeps the hash honest should the resize rule change)."""
    return processor_settings if grid is None else {**processor_settings, "grid": list(grid)}


def mm_hash(image: Image.Image, processor_settings: Mapping[str, Any], model_id: str, cache_salt: str = "") -> str:
    """SHA-256 hex digest of an image's RGB pixels, size, processor settings, model id and cache salt.

    The pixels go in as row-major RGB bytes, fed in strips of at most
    ``STRIP_BYTES`` (the same digest as one ``tobytes()``, without its copy).
    ``cache_salt`` must pass ``check_cache_salt``; ``""`` = no tenant (shared caches).
    """
    digest = _header(b"epd-mm-v1", model_id, processor_settings, cache_salt)
    _update_pixels(digest, image)
    return digest.hexdigest()


def video_hash(frames: Sequence[Image.Image], settings: Mapping[str, Any], model_id: str, cache_salt: str = "") -> str:
    """``mm_hash`` of a video: its sampled frames' RGB pixels in order, under a tag of its own.

    ``settings`` holds the processor settings, the sampling and the grid, so the
    same file sampled otherwise is another entry. Never equal to an image's hash.
    """
    digest = _header(b"epd-mm-video-v1", model_id, settings, cache_salt)
    digest.update(f"{len(frames)}".encode() + b"\0")
    for frame in frames:
        _update_pixels(digest, frame)
    return digest.hexdigest()


def _header(tag: bytes, model_id: str, settings: Mapping[str, Any], cache_salt: str) -> Any:
    digest = hashlib.sha256()
    if cache_salt:
        # Its own tag: a salted stream can never equal an unsalted one; the salt is fixed-width.
        digest.update(tag.replace(b"-v1", b"-salted-v1") + b"\0" + check_cache_salt(cache_salt).encode() + b"\0")
    else:
        digest.update(tag + b"\0")
    digest.update(model_id.encode())
    digest.update(b"\0")
    digest.update(_canonical(settings))
    digest.update(b"\0")
    return digest


def _update_pixels(digest: Any, image: Image.Image) -> None:
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest.update(f"{rgb.width}x{rgb.height}".encode())
    digest.update(b"\0")
    rows = max(1, STRIP_BYTES // (3 * rgb.width))
    for top in range(0, rgb.height, rows):
        digest.update(rgb.crop((0, top, rgb.width, min(rgb.height, top + rows))).tobytes())

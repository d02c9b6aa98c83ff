"""mm_hash depends on pixels, processor settings and model id, not on the file format."""

import io

import pytest
from PIL import Image

from services.common.hashing import check_cache_salt, mm_hash

SETTINGS = {"size": {"shortest_edge": 32}, "image_mean": [0.5, 0.5, 0.5]}


def _image(color=(10, 20, 30), size=(8, 6)):
    img = Image.new("RGB", size, color)
    img.putpixel((1, 1), (200, 100, 0))
    return img


def _reencode(img, fmt, **kwargs):
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    buf.seek(0)
    return Image.open(buf)


def test_same_pixels_in_different_formats_hash_the_same():
    img = _image()
    png = _reencode(img, "PNG")
    webp = _reencode(img, "WEBP", lossless=True)
    assert mm_hash(png, SETTINGS, "m") == mm_hash(webp, SETTINGS, "m") == mm_hash(img, SETTINGS, "m")


def test_one_pixel_changes_the_hash():
    a, b = _image(), _image()
    b.putpixel((0, 0), (11, 20, 30))
    assert mm_hash(a, SETTINGS, "m") != mm_hash(b, SETTINGS, "m")


def test_size_settings_and_model_are_part_of_the_key():
    img = _image()
    base = mm_hash(img, SETTINGS, "m")
    assert mm_hash(img, {**SETTINGS, "image_mean": [0.4, 0.5, 0.5]}, "m") != base
    assert mm_hash(img, SETTINGS, "other-model") != base
    # Same pixel bytes, different geometry.
    flat = Image.frombytes("RGB", (6, 8), img.tobytes())
    assert mm_hash(flat, SETTINGS, "m") != base


def test_settings_key_order_does_not_matter():
    img = _image()
    reordered = dict(reversed(list(SETTINGS.items())))
    assert mm_hash(img, SETTINGS, "m") == mm_hash(img, reordered, "m")


def test_non_rgb_modes_hash_as_their_rgb_pixels():
    rgba = _image().convert("RGBA")
    assert mm_hash(rgba, SETTINGS, "m") == mm_hash(rgba.convert("RGB"), SETTINGS, "m")
    assert len(mm_hash(rgba, SETTINGS, "m")) == 64


def _whole_image_digest(img, settings, model_id) -> str:
    """The definition of mm_hash, with one tobytes() of the whole image."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for part in (
        b"epd-mm-v1\0",
        model_id.encode(),
        b"\0",
        json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str).encode(),
        b"\0",
        f"{img.width}x{img.height}".encode(),
        b"\0",
        img.tobytes(),
    ):
        digest.update(part)
    return digest.hexdigest()


def test_strip_hashing_gives_the_whole_image_digest():
    import torch

    for width, height in ((8, 6), (1500, 701), (3, 400_000)):  # strips of one row, many rows, ragged end
        pixels = torch.randint(
            0, 256, (height, width, 3), generator=torch.Generator().manual_seed(width), dtype=torch.uint8
        )
        img = Image.fromarray(pixels.numpy(), "RGB")
        assert mm_hash(img, SETTINGS, "m") == _whole_image_digest(img, SETTINGS, "m")


def test_hashing_a_large_image_holds_no_full_copy_of_its_pixels():
    # Defect 4: hashing made a tobytes() copy of the whole decoded image (48 MiB for 4096 x 4096).
    import tracemalloc

    img = Image.new("RGB", (2048, 2048), (1, 2, 3))  # 12 MiB of pixels
    tracemalloc.start()
    try:
        mm_hash(img, SETTINGS, "m")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * 2**20


def test_a_cache_salt_gives_each_tenant_its_own_hash_and_no_salt_keeps_the_shared_one():
    img = _image()
    shared = mm_hash(img, SETTINGS, "m")
    a, b = mm_hash(img, SETTINGS, "m", "a" * 64), mm_hash(img, SETTINGS, "m", "b" * 64)
    assert len({shared, a, b}) == 3
    assert a == mm_hash(_reencode(img, "PNG"), SETTINGS, "m", "a" * 64)
    assert mm_hash(img, SETTINGS, "m", "") == shared


def test_a_malformed_cache_salt_is_refused_without_being_named():
    assert check_cache_salt("") == "" and check_cache_salt("0" * 64) == "0" * 64
    for bad in ("A" * 64, "0" * 63, "0" * 65, "secret-salt"):
        with pytest.raises(ValueError) as refused:
            check_cache_salt(bad)
        assert bad not in str(refused.value)
        with pytest.raises(ValueError):
            mm_hash(_image(), SETTINGS, "m", bad)

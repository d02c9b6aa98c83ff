"""The encoder's one reading of an EncodeItem's pixels: processed pixel_values, or an image file it decodes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from oracle_support import make_image
from PIL import Image

from services.common import encode_items, wire
from services.common.encode_items import file_processor, item_pixels
from services.common.hashing import hash_settings, mm_hash
from services.common.pb import epd_pb2

QWEN = "qwen2.5-vl-tiny"


@pytest.fixture(scope="module")
def qwen(build_model):
    from services.common.models import load_adapter

    adapter = load_adapter(str(build_model(QWEN)))
    image_processor = adapter.load_processor().image_processor
    return adapter, image_processor, file_processor(adapter, image_processor)


def _file(image: Image.Image, kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, kind)
    return out.getvalue()


def _item(grid, mm_hash="m", **fields) -> epd_pb2.EncodeItem:
    grid_pb = None if grid is None else epd_pb2.ImageGrid(t=grid[0], h=grid[1], w=grid[2])
    return epd_pb2.EncodeItem(mm_hash=mm_hash, reservation_id="r", grid=grid_pb, **fields)


def _hash(adapter, image, grid) -> str:
    """The proxy's mm_hash of ``image`` (``Preprocessor``)."""
    return mm_hash(image, hash_settings(adapter.processor_settings(), grid), adapter.model_id)


@pytest.mark.parametrize("size", [(64, 64), (97, 33), (17, 400), (1000, 750), (31, 31)])
def test_an_image_file_becomes_the_processors_own_pixels_with_the_proxys_grid(qwen, size):
    adapter, image_processor, process_file = qwen
    image = make_image(7, size)
    reference = adapter.process_image(image_processor, image)  # transformers' processor on the decoded image
    shape = adapter.image_shape(image.height, image.width)  # what the proxy counts, from the size alone
    assert (shape.num_tokens, shape.patch_grid, shape.token_grid) == (
        reference.num_tokens,
        reference.patch_grid,
        reference.token_grid,
    )
    item = _item(shape.patch_grid, _hash(adapter, image, shape.patch_grid), image_file=_file(image))
    pixels, grid = item_pixels(item, 0, adapter.pixel_layout(), process_file)
    assert grid == reference.patch_grid
    assert pixels.numpy().tobytes() == reference.pixel_values.tobytes()  # bit for bit


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (lambda grid, data: _item(grid), "exactly one of pixel_values, image_file, video_file and frame_files"),
        (
            lambda grid, data: _item(
                grid, image_file=data, pixel_values=wire.array_to_pb(np.zeros((4, 4), np.float32))
            ),
            "exactly one of pixel_values, image_file, video_file and frame_files",
        ),
        (lambda grid, data: _item((1, 2, 2), image_file=data), "grid must be the patch grid"),
        (lambda grid, data: _item(None, image_file=data), "grid must be the patch grid"),
        (lambda grid, data: _item(grid, image_file=b"%PDF-1.4"), "not a PNG, JPEG, WEBP or GIF"),
        (lambda grid, data: _item(grid, image_file=data[: len(data) // 2]), "image_file: The image"),
    ],
)
def test_a_bad_image_file_is_refused_naming_the_rule(qwen, item, message):
    adapter, _, process_file = qwen
    image = make_image(8, (64, 48))
    grid = adapter.image_shape(image.height, image.width).patch_grid
    with pytest.raises(ValueError, match="item 0: ") as raised:
        item_pixels(item(grid, _file(image, "JPEG")), 0, adapter.pixel_layout(), process_file)
    assert message in str(raised.value)


def test_a_file_over_the_decode_cap_is_refused_from_its_header(qwen, monkeypatch):
    adapter, _, process_file = qwen
    monkeypatch.setattr(encode_items, "MAX_FILE_PIXELS", 32 * 32)
    data = _file(Image.new("RGB", (64, 64)))
    with pytest.raises(ValueError, match="image_file: The image has 4096 pixels; the limit is 1024"):
        item_pixels(_item((1, 8, 8), image_file=data), 0, adapter.pixel_layout(), process_file)


def test_where_files_are_not_taken_pixel_values_still_are(tiny_model_dir):
    from services.common.models import load_adapter

    adapter = load_adapter(str(tiny_model_dir))
    image = make_image(9)
    with pytest.raises(ValueError, match="image_file is not taken here"):
        item_pixels(_item(None, image_file=_file(image)), 0, adapter.pixel_layout(), None)
    processed = adapter.process_image(adapter.load_processor().image_processor, image)
    pixel_item = epd_pb2.EncodeItem(
        mm_hash="m", reservation_id="r", pixel_values=wire.array_to_pb(processed.pixel_values)
    )
    pixels, grid = item_pixels(pixel_item, 0, adapter.pixel_layout(), None)
    assert grid is None and torch.equal(pixels, torch.from_numpy(processed.pixel_values))


def test_an_image_file_under_another_images_hash_is_refused(qwen):
    """First review, still open then: PD's embedding cache could be poisoned through an honest encoder
    (an embedding stored under whatever mm_hash the call named)."""
    adapter, _, process_file = qwen
    image, other = make_image(10, (64, 48)), make_image(11, (64, 48))
    grid = adapter.image_shape(image.height, image.width).patch_grid
    data = _file(image)
    honest = _item(grid, _hash(adapter, image, grid), image_file=data)
    assert item_pixels(honest, 0, adapter.pixel_layout(), process_file)[1] == grid
    forged = _item(grid, _hash(adapter, other, grid), image_file=data)
    with pytest.raises(ValueError, match="item 0: mm_hash is not the hash of the image"):
        item_pixels(forged, 0, adapter.pixel_layout(), process_file)


def test_an_image_file_is_checked_against_its_hash_under_the_requests_cache_salt(qwen):
    """The cross-user side channel: a tenant's images are hashed with its salt, and the
    encoder, which hashes the file again, must hash it under the same salt or refuse the item."""
    adapter, _, process_file = qwen
    image = make_image(12, (64, 48))
    grid = adapter.image_shape(image.height, image.width).patch_grid
    salt, other = "a" * 64, "b" * 64
    salted = mm_hash(image, hash_settings(adapter.processor_settings(), grid), adapter.model_id, salt)
    item = _item(grid, salted, image_file=_file(image))
    assert item_pixels(item, 0, adapter.pixel_layout(), process_file, salt)[1] == grid
    for wrong in ("", other):  # the salted hash under no salt, or under another tenant's salt
        with pytest.raises(ValueError, match="item 0: mm_hash is not the hash of the image under the request"):
            item_pixels(item, 0, adapter.pixel_layout(), process_file, wrong)
    unsalted = _item(grid, _hash(adapter, image, grid), image_file=_file(image))
    with pytest.raises(ValueError, match="not the hash of the image"):
        item_pixels(unsalted, 0, adapter.pixel_layout(), process_file, salt)

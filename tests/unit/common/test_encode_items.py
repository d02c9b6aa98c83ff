"""The encoder's one reading of an EncodeItem's pixels: processed pixel_values, or a resized image it finishes."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from oracle_support import make_image

from services.common import wire
from services.common.encode_items import item_pixels
from services.common.pb import epd_pb2

QWEN = "qwen2.5-vl-tiny"


@pytest.fixture(scope="module")
def qwen(build_model):
    from services.common.models import load_adapter

    adapter = load_adapter(str(build_model(QWEN)))
    image_processor = adapter.load_processor().image_processor
    return adapter, image_processor, functools.partial(adapter.finish_image, image_processor)


def _item(grid, **tensor) -> epd_pb2.EncodeItem:
    t, h, w = grid
    return epd_pb2.EncodeItem(mm_hash="m", reservation_id="r", grid=epd_pb2.ImageGrid(t=t, h=h, w=w), **tensor)


@pytest.mark.parametrize("size", [(64, 64), (97, 33), (17, 400), (1000, 750), (31, 31)])
def test_a_resized_image_finishes_into_the_processors_own_pixels(qwen, size):
    adapter, image_processor, finish = qwen
    image = make_image(7, size)
    reference = adapter.process_image(image_processor, image)  # transformers' processor, end to end
    sent = adapter.prepare_image(image_processor, image)
    assert sent.resized and sent.pixel_values.dtype == np.uint8
    assert (sent.num_tokens, sent.patch_grid, sent.token_grid) == (
        reference.num_tokens,
        reference.patch_grid,
        reference.token_grid,
    )
    pixels, grid = item_pixels(
        _item(sent.patch_grid, image=wire.array_to_pb(sent.pixel_values)), 0, adapter.pixel_layout(), finish
    )
    assert grid == reference.patch_grid
    assert pixels.numpy().tobytes() == reference.pixel_values.tobytes()  # bit for bit


def _resized(qwen, size=(64, 48)):
    adapter, image_processor, _ = qwen
    return adapter.prepare_image(image_processor, make_image(8, size))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda sent: _item(sent.patch_grid), "exactly one of pixel_values and image"),
        (
            lambda sent: _item(
                sent.patch_grid,
                image=wire.array_to_pb(sent.pixel_values),
                pixel_values=wire.array_to_pb(np.zeros((4, 4), np.float32)),
            ),
            "exactly one of pixel_values and image",
        ),
        (lambda sent: _item(sent.patch_grid, image=wire.array_to_pb(sent.pixel_values.astype(np.float32))), "uint8"),
        (lambda sent: _item((1, 2, 2), image=wire.array_to_pb(sent.pixel_values)), "grid must be the patch grid"),
        (lambda sent: _item(sent.patch_grid, image=wire.array_to_pb(sent.pixel_values[:-1])), "multiples of"),
        (lambda sent: _item(sent.patch_grid, image=wire.array_to_pb(sent.pixel_values[..., :2])), "[H, W, 3]"),
        (
            lambda sent: _item(sent.patch_grid, image=epd_pb2.Tensor(dtype=epd_pb2.DTYPE_UINT8, shape=[4], data=b"x")),
            "not valid",
        ),
    ],
)
def test_a_bad_resized_image_is_refused_naming_the_rule(qwen, change, message):
    adapter, _, finish = qwen
    with pytest.raises(ValueError, match="item 0: ") as raised:
        item_pixels(change(_resized(qwen)), 0, adapter.pixel_layout(), finish)
    assert message in str(raised.value)


def test_an_image_larger_than_the_model_takes_is_refused_before_processing(qwen):
    adapter, image_processor, finish = qwen
    side = 16 * 64  # far over the tiny preset's max_pixels x the slack the layout allows
    big = np.zeros((side, side, 3), np.uint8)
    with pytest.raises(ValueError, match="more pixels than this model takes"):
        item_pixels(_item((1, side // 8, side // 8), image=wire.array_to_pb(big)), 0, adapter.pixel_layout(), finish)


def test_a_model_that_takes_pixel_values_refuses_an_image(tiny_model_dir):
    from services.common.models import load_adapter

    adapter = load_adapter(str(tiny_model_dir))
    sent = adapter.prepare_image(adapter.load_processor().image_processor, make_image(9))
    assert not sent.resized and sent.pixel_values.dtype == np.float32  # LLaVA's pixels are as small as the image
    item = epd_pb2.EncodeItem(mm_hash="m", reservation_id="r", image=wire.array_to_pb(np.zeros((32, 32, 3), np.uint8)))
    with pytest.raises(ValueError, match="takes pixel_values, not a resized image"):
        item_pixels(item, 0, adapter.pixel_layout(), None)
    pixels, grid = item_pixels(
        epd_pb2.EncodeItem(mm_hash="m", reservation_id="r", pixel_values=wire.array_to_pb(sent.pixel_values)),
        0,
        adapter.pixel_layout(),
        None,
    )
    assert grid is None and torch.equal(pixels, torch.from_numpy(sent.pixel_values))

"""Encode calls of dynamic-resolution models: grids validated at the door, images of different grids in one forward."""

from __future__ import annotations

import asyncio

import pytest
import torch
from oracle_support import make_image

from services.common import tensors
from services.common.grids import grid_to_pb
from services.common.models import PixelLayout, load_adapter
from services.common.pb import epd_pb2
from services.encoder.batcher import Batcher
from services.encoder.cache import EmbeddingCache
from services.encoder.convert import parse_encode_request
from services.encoder.errors import InvalidInput

LAYOUT = PixelLayout(patch_dim=12, merge_size=2, max_patches=64)
HASH = "cd" * 32


def _request(pixels: torch.Tensor, grid) -> epd_pb2.EncodeRequest:
    return epd_pb2.EncodeRequest(
        request_id="r",
        pd_address="127.0.0.1:1",
        items=[
            epd_pb2.EncodeItem(
                mm_hash=HASH, reservation_id="res", pixel_values=tensors.to_pb(pixels), grid=grid_to_pb(grid)
            )
        ],
    )


def test_valid_patches_with_their_grid_are_accepted():
    work = parse_encode_request(_request(torch.zeros(8, 12), (1, 2, 4)), LAYOUT)
    assert work.items[0].grid == (1, 2, 4) and tuple(work.items[0].pixel_values.shape) == (8, 12)


@pytest.mark.parametrize(
    ("pixels", "grid", "message"),
    [
        (torch.zeros(8, 12), None, "grid is required"),
        (torch.zeros(8, 12), (1, 2, 3), "multiples of 2"),
        (torch.zeros(6, 12), (1, 2, 4), r"shape \[t\*h\*w, 12\]"),
        (torch.zeros(8, 10), (1, 2, 4), r"shape \[t\*h\*w, 12\]"),
        (torch.zeros(160, 12), (1, 10, 16), "more than 64 patches a frame"),
        (torch.zeros(8 * 385, 12), (385, 2, 4), "more than 384 temporal patches"),
        (torch.full((8, 12), float("nan")), (1, 2, 4), "finite"),
    ],
)
def test_malformed_grids_and_patches_are_invalid_arguments(pixels, grid, message):
    with pytest.raises(InvalidInput, match=message):
        parse_encode_request(_request(pixels, grid), LAYOUT)


def test_a_zero_grid_dimension_and_a_grid_for_a_fixed_size_model_are_refused():
    message = _request(torch.zeros(8, 12), (1, 2, 4))
    message.items[0].grid.t = 0
    with pytest.raises(InvalidInput, match="not valid"):
        parse_encode_request(message, LAYOUT)
    with pytest.raises(InvalidInput, match="grid must not be set"):
        parse_encode_request(_request(torch.zeros(3, 8, 8), (1, 2, 2)))  # default layout: LLaVA's


async def test_images_of_different_grids_share_one_forward(build_model):
    adapter = load_adapter(build_model("qwen2.5-vl-tiny"))
    vision = adapter.load_vision(torch.device("cpu"), torch.float32)
    forwards = []
    vision.register_forward_hook(lambda module, args, out: forwards.append(args[1].shape[0]))
    image_processor = adapter.load_processor().image_processor
    images = [
        adapter.process_image(image_processor, make_image(k, size))
        for k, size in enumerate([(96, 32), (32, 80), (64, 64)])
    ]
    pixels = [torch.from_numpy(i.pixel_values) for i in images]
    singles = [vision(p, torch.tensor([i.patch_grid])) for p, i in zip(pixels, images)]
    forwards.clear()
    batcher = Batcher(
        vision,
        EmbeddingCache(1 << 20),
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_batch_images=3,
        max_wait_ms=5000,
        max_pending=8,
    )
    batcher.start()
    try:
        results = await asyncio.gather(
            *(batcher.encode(f"{k:064x}", p, None, i.patch_grid) for k, (p, i) in enumerate(zip(pixels, images)))
        )
    finally:
        await asyncio.to_thread(batcher.stop)
    assert forwards == [3]  # one packed forward over three grids
    for result, single, image in zip(results, singles, images):
        assert result.embedding.shape == (image.num_tokens, adapter.hidden_size)
        torch.testing.assert_close(result.embedding, single, rtol=1e-5, atol=1e-5)

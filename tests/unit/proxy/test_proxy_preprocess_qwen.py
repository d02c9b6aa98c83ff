"""Preprocessing for Qwen2.5-VL: dynamic-resolution token counts, grids on the wire, the same limits."""

from __future__ import annotations

import pytest
import torch
from oracle_support import data_url, make_image, user_message

from services.common.encode_items import file_processor, item_pixels
from services.common.pb import epd_pb2
from services.proxy.errors import ImageError, ImageTooLargeError, PlaceholderMismatchError
from services.proxy.prompt.preprocess import Preprocessor

PRESET = "qwen2.5-vl-tiny"


@pytest.fixture(scope="module")
def preprocessor(build_model) -> Preprocessor:
    from services.common.models import load_adapter

    adapter = load_adapter(str(build_model(PRESET)))
    return Preprocessor(adapter, adapter.load_processor(), max_images=4, max_image_pixels=256 * 256)


def test_placeholders_grids_and_pixels_match_transformers(preprocessor, oracle_for):
    images = [make_image(1, (96, 32)), make_image(2, (32, 80)), make_image(3, (64, 64))]
    messages = [{"role": "system", "content": "Be terse."}, user_message("Compare.", images)]
    prompt = preprocessor.chat_prompt(messages)
    oracle = oracle_for(PRESET)
    assert prompt.token_ids == oracle.prompt_ids(messages, images)
    reference = oracle.inputs(messages, images)
    assert [item.patch_grid for item in prompt.images] == [tuple(g.tolist()) for g in reference["image_grid_thw"]]
    # The proxy sends each image file; the encoder's reading of the wire decodes and processes
    # it into exactly the processor's pixels, with the grid the proxy counted.
    adapter = preprocessor.adapter
    process_file = file_processor(adapter, adapter.load_processor().image_processor)
    finished = []
    for item in prompt.images:
        pb = item.encode_item_pb("reservation")
        assert pb.image_file and not pb.HasField("pixel_values")
        pixels, grid = item_pixels(pb, 0, adapter.pixel_layout(), process_file)
        assert grid == item.patch_grid
        finished.append(pixels)
    pixels = torch.cat(finished)
    torch.testing.assert_close(pixels, reference["pixel_values"])
    assert pixels.numpy().tobytes() == reference["pixel_values"].float().contiguous().numpy().tobytes()
    for item in prompt.images:
        t, h, w = item.token_grid
        assert t * h * w == item.num_tokens
        assert prompt.token_ids[item.offset - 1] == preprocessor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert len({item.num_tokens for item in prompt.images}) == 3  # each keeps its own size
    wire = prompt.mm_items_pb()
    assert all(item.HasField("grid") for item in wire)
    assert [(g.grid.t, g.grid.h, g.grid.w) for g in wire] == [item.token_grid for item in prompt.images]


def test_fixed_size_models_send_no_grid(tiny_model_dir):
    from services.common.models import load_adapter

    adapter = load_adapter(str(tiny_model_dir))
    llava = Preprocessor(adapter, adapter.load_processor(), max_images=4, max_image_pixels=256 * 256)
    [item] = llava.chat_prompt([user_message("look", [make_image(4)])]).mm_items_pb()
    assert not item.HasField("grid") and item == epd_pb2.MultiModalItem(
        mm_hash=item.mm_hash, offset=item.offset, num_tokens=item.num_tokens
    )


def test_hash_covers_the_resize_settings(preprocessor):
    settings = preprocessor.adapter.processor_settings()
    assert {"patch_size", "merge_size", "temporal_patch_size", "size"} <= set(settings)
    image = make_image(5, (48, 40))
    first = preprocessor.chat_prompt([user_message("a", [image])]).images[0]
    again = preprocessor.chat_prompt([user_message("b", [image])]).images[0]
    assert first.mm_hash == again.mm_hash
    other = Preprocessor(preprocessor.adapter, preprocessor.processor, max_images=4, max_image_pixels=256 * 256)
    other._settings = {**settings, "merge_size": 4}
    assert other.chat_prompt([user_message("a", [image])]).images[0].mm_hash != first.mm_hash


def test_limits_and_refusals_still_hold(preprocessor):
    with pytest.raises(ImageTooLargeError):  # checked from the header, before decoding
        preprocessor.chat_prompt(
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": data_url(make_image(6, (300, 300)))}}],
                }
            ]
        )
    with pytest.raises(ImageError, match="aspect ratio") as refused:
        preprocessor.chat_prompt([user_message("thin", [make_image(7, (1, 250))])])
    assert refused.value.code == "invalid_image"
    with pytest.raises(PlaceholderMismatchError):
        preprocessor.chat_prompt([{"role": "user", "content": "sneaky <|image_pad|> here"}])

"""Preprocessing against the tiny checkpoint's real HF processor (no weights loaded)."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from services.proxy.errors import (
    InvalidBase64Error,
    PlaceholderMismatchError,
    RequestError,
    TooManyImagesError,
)
from services.proxy.preprocess import Preprocessor


@pytest.fixture(scope="module")
def preprocessor(tiny_model_dir) -> Preprocessor:
    from services.common.models import load_adapter

    adapter = load_adapter(str(tiny_model_dir))
    return Preprocessor(adapter, adapter.load_processor(), max_images=4, max_image_pixels=512 * 512)


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def data_url(image: Image.Image, fmt: str = "PNG", **save_kwargs) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_kwargs)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def user(*parts) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": p}} if p.startswith("data:") else {"type": "text", "text": p}
        for p in parts
    ]
    return {"role": "user", "content": content}


def test_placeholder_expansion_matches_the_hf_processor(preprocessor):
    images = [picture(40, 30, seed=1), picture(17, 64, seed=2)]
    messages = [
        {"role": "system", "content": "You are terse."},
        user("Compare", data_url(images[0]), "with", data_url(images[1])),
        {"role": "assistant", "content": "They differ."},
        user("Why?"),
    ]
    prompt = preprocessor.chat_prompt(messages)
    rendered = preprocessor.render(messages)
    processor = preprocessor.processor
    expected = processor(text=rendered, images=images)["input_ids"][0]
    assert prompt.token_ids == list(expected)
    adapter = preprocessor.adapter
    for item, image in zip(prompt.images, images):
        assert item.num_tokens == adapter.num_image_tokens(image.height, image.width)
        span = prompt.token_ids[item.offset:item.offset + item.num_tokens]
        assert span == [adapter.image_token_id] * item.num_tokens
    assert prompt.token_ids.count(adapter.image_token_id) == prompt.num_image_tokens
    assert [i.offset for i in prompt.images] == sorted(i.offset for i in prompt.images)


def test_pixel_values_match_the_hf_processor(preprocessor):
    image = picture(50, 20, seed=3)
    prompt = preprocessor.chat_prompt([user("look", data_url(image))])
    expected = preprocessor.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
    [item] = prompt.images
    assert item.pixel_values.dtype == torch.float32 and item.pixel_values.dim() == 3
    torch.testing.assert_close(item.pixel_values, expected.float())


def test_string_and_text_part_content_tokenize_the_same(preprocessor):
    as_string = preprocessor.chat_prompt([{"role": "user", "content": "hello there"}])
    as_parts = preprocessor.chat_prompt([user("hello there")])
    assert as_string.token_ids == as_parts.token_ids and as_string.images == ()


def test_same_pixels_in_png_and_lossless_webp_hash_the_same(preprocessor):
    image = picture(32, 24, seed=4)
    png = preprocessor.chat_prompt([user(data_url(image, "PNG"))]).images[0]
    webp = preprocessor.chat_prompt([user(data_url(image, "WEBP", lossless=True))]).images[0]
    assert png.mm_hash == webp.mm_hash
    other = preprocessor.chat_prompt([user(data_url(picture(32, 24, seed=5)))]).images[0]
    assert other.mm_hash != png.mm_hash
    one_pixel_changed = image.copy()
    one_pixel_changed.putpixel((0, 0), tuple((c + 1) % 256 for c in image.getpixel((0, 0))))
    changed = preprocessor.chat_prompt([user(data_url(one_pixel_changed))]).images[0]
    assert changed.mm_hash != png.mm_hash


def test_text_must_not_contain_the_image_token(preprocessor):
    token = preprocessor.adapter.image_token
    with pytest.raises(PlaceholderMismatchError):
        preprocessor.chat_prompt([{"role": "user", "content": f"sneaky {token} here"}])
    with pytest.raises(PlaceholderMismatchError):
        preprocessor.completion_prompt(f"a {token}")
    with pytest.raises(PlaceholderMismatchError):
        preprocessor.completion_prompt([1, preprocessor.adapter.image_token_id])


def test_too_many_images_is_checked_before_decoding(preprocessor):
    garbage = "data:image/png;base64,!!!"
    with pytest.raises(TooManyImagesError):
        preprocessor.chat_prompt([user(*[garbage] * 5)])
    with pytest.raises(InvalidBase64Error):
        preprocessor.chat_prompt([user(garbage)])


def test_completion_prompts(preprocessor):
    prompt = preprocessor.completion_prompt("Once upon a time")
    assert prompt.token_ids == preprocessor.tokenizer("Once upon a time")["input_ids"]
    ids = [t for t in range(10, 14) if t != preprocessor.adapter.image_token_id]
    assert preprocessor.completion_prompt(ids).token_ids == ids
    with pytest.raises(RequestError):
        preprocessor.completion_prompt([len(preprocessor.tokenizer) + 5])
    with pytest.raises(RequestError):
        preprocessor.completion_prompt([])

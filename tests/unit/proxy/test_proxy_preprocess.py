"""Preprocessing against the tiny checkpoint's real HF processor (no weights loaded)."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from services.common.encode_items import file_processor, item_pixels
from services.proxy.errors import (
    InvalidBase64Error,
    PlaceholderMismatchError,
    RequestError,
    TooManyImagesError,
)
from services.proxy.prompt.preprocess import Preprocessor


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
        span = prompt.token_ids[item.offset : item.offset + item.num_tokens]
        assert span == [adapter.image_token_id] * item.num_tokens
    assert prompt.token_ids.count(adapter.image_token_id) == prompt.num_image_tokens
    assert [i.offset for i in prompt.images] == sorted(i.offset for i in prompt.images)


def test_the_encoder_gets_the_file_and_makes_the_hf_processors_pixels_of_it(preprocessor):
    image = picture(50, 20, seed=3)
    prompt = preprocessor.chat_prompt([user("look", data_url(image))])
    expected = preprocessor.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
    [item] = prompt.images
    pb = item.encode_item_pb("reservation")
    assert pb.image_file == item.image_file and not pb.HasField("pixel_values")
    adapter = preprocessor.adapter
    process_file = file_processor(adapter, adapter.load_processor().image_processor)
    pixels, grid = item_pixels(pb, 0, adapter.pixel_layout(), process_file)
    assert grid is None and pixels.dtype == torch.float32 and pixels.dim() == 3
    torch.testing.assert_close(pixels, expected.float())
    assert pixels.numpy().tobytes() == expected.float().contiguous().numpy().tobytes()


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


# -- limits before work (issue 16) -------------------------------------------------
@pytest.fixture(scope="module")
def adapter_and_processor(tiny_model_dir):
    from services.common.models import load_adapter

    adapter = load_adapter(str(tiny_model_dir))
    return adapter, adapter.load_processor()


def _decode_spy(monkeypatch):
    """Wraps the decoder: records how many decoded images were still alive at each call."""
    import gc
    import threading
    import weakref

    from services.proxy.prompt import images, preprocess

    decoded: list[weakref.ref] = []
    alive_at_call: list[int] = []
    real = images.decode_image_bytes

    def alive(ref: weakref.ref) -> bool:
        image = ref()
        try:
            return image is not None and image.im is not None
        except ValueError:  # closed: its pixels are gone
            return False

    test_thread = threading.get_ident()

    def spy(data, max_pixels):
        if threading.get_ident() != test_thread:  # another test's leftover work: not ours to count
            return real(data, max_pixels)
        gc.collect()
        alive_at_call.append(sum(alive(ref) for ref in decoded))
        image = real(data, max_pixels)
        decoded.append(weakref.ref(image))
        return image

    for module in (preprocess, images):  # wherever the decoder is looked up from
        monkeypatch.setattr(module, "decode_image_bytes", spy, raising=False)
    return alive_at_call


def test_the_request_pixel_budget_is_checked_before_any_image_is_decoded(adapter_and_processor, monkeypatch):
    adapter, processor = adapter_and_processor
    preprocessor = Preprocessor(adapter, processor, max_images=4, max_image_pixels=512 * 512, max_request_pixels=3000)
    alive_at_call = _decode_spy(monkeypatch)
    images = [data_url(picture(40, 40, seed=i)) for i in range(2)]  # 1600 pixels each, 3200 together
    with pytest.raises(RequestError) as refused:
        preprocessor.chat_prompt([user("two", *images)])
    assert refused.value.code == "too_many_image_pixels" and "3200" in refused.value.message
    assert alive_at_call == []  # nothing was decoded
    assert len(preprocessor.chat_prompt([user("one", images[0])]).images) == 1


def test_images_are_decoded_one_at_a_time_and_each_is_released_before_the_next(adapter_and_processor, monkeypatch):
    # Defect 4: every image of a request was decoded first and all held until the end.
    adapter, processor = adapter_and_processor
    preprocessor = Preprocessor(adapter, processor, max_images=4, max_image_pixels=512 * 512)
    alive_at_call = _decode_spy(monkeypatch)
    images = [data_url(picture(48, 40, seed=i)) for i in range(4)]
    prompt = preprocessor.chat_prompt([user("four", *images)])
    assert len(prompt.images) == 4 and alive_at_call == [0, 0, 0, 0]


def test_text_too_long_for_the_context_is_refused_before_tokenizing(adapter_and_processor, monkeypatch):
    adapter, processor = adapter_and_processor
    preprocessor = Preprocessor(adapter, processor, max_images=4, max_image_pixels=512 * 512, max_model_len=32)
    long_text = "word " * 10_000

    class NoTokenizing:
        bos_token = processor.tokenizer.bos_token

        def __call__(self, *args, **kwargs):
            raise AssertionError("tokenized text that could not fit")

    monkeypatch.setattr(preprocessor, "tokenizer", NoTokenizing())
    with pytest.raises(RequestError) as chat:
        preprocessor.chat_tokens([user(long_text)])
    with pytest.raises(RequestError) as completion:
        preprocessor.completion_prompt(long_text)
    assert chat.value.code == completion.value.code == "context_length_exceeded"
    assert "word" not in chat.value.message


def test_chat_template_kwargs_are_template_variables(preprocessor, monkeypatch):
    processor = preprocessor.processor
    owner = processor if getattr(processor, "chat_template", None) else processor.tokenizer  # whose template renders
    monkeypatch.setattr(owner, "chat_template", "{% if persona %}[{{ persona }}]{% endif %}" + owner.chat_template)
    messages = [{"role": "user", "content": "hello there"}]
    assert preprocessor.render(messages, {"persona": "pirate"}).startswith("[pirate]")
    assert not preprocessor.render(messages).startswith("[")

"""The correctness oracle: ``transformers`` ``generate()`` on the full checkpoint."""

from __future__ import annotations

import base64
import io
import json
import threading
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def make_image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """A deterministic noise image (distinct per seed)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def user_message(text: str, images: list[Image.Image]) -> dict:
    """An OpenAI chat message with the images first, then the text."""
    if not images:
        return {"role": "user", "content": text}
    parts = [{"type": "image_url", "image_url": {"url": data_url(img)}} for img in images]
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}


def _hf_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages in the chat template's form (image parts lose their URL)."""
    hf_messages = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image"} if part["type"] == "image_url" else {"type": "text", "text": part["text"]}
                for part in content
            ]
        hf_messages.append({"role": message["role"], "content": content})
    return hf_messages


class Oracle:
    """Greedy reference tokens from the full checkpoint's ``generate()`` (LLaVA, Qwen2-VL, Qwen2.5-VL)."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForImageTextToText

        self.model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
        self.inputs = _LlavaInputs(model_dir) if self.model_type == "llava" else _QwenInputs(model_dir)
        self.processor = self.inputs.processor
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.lock = threading.Lock()

    def prompt_ids(self, messages: list[dict], images: list[Image.Image]) -> list[int]:
        """The prompt's token ids, image placeholders expanded, as ``generate()`` sees them."""
        return self.inputs(messages, images)["input_ids"][0].tolist()

    def generate(self, messages: list[dict], images: list[Image.Image], max_tokens: int, **options) -> list[int]:
        """Greedy new tokens; ``options`` go to ``generate()`` (e.g. ``min_new_tokens``, ``eos_token_id``)."""
        inputs = self.inputs(messages, images)
        with self.lock, torch.inference_mode():
            output = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, **options)
        return output[0, inputs["input_ids"].shape[1] :].tolist()

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids ``generate()`` stops on (a checkpoint may name one or several)."""
        eos = self.model.generation_config.eos_token_id
        return list(eos) if isinstance(eos, list | tuple) else [eos]

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.tokenizer.decode(token_ids, skip_special_tokens=True)


class _LlavaInputs:
    """Model inputs from transformers' own processor (``AutoProcessor``)."""

    def __init__(self, model_dir: str):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)

    def __call__(self, messages: list[dict], images: list[Image.Image]) -> dict:
        text = self.processor.apply_chat_template(_hf_messages(messages), add_generation_prompt=True, tokenize=False)
        return self.processor(text=text, images=images or None, return_tensors="pt")


class _QwenInputs:
    """Model inputs as transformers' Qwen2-VL processor builds them, from its tokenizer and image
    processor (the processor class itself needs torchvision, for its video half): each
    ``<|image_pad|>`` repeated once per image token, ``image_grid_thw``, ``mm_token_type_ids``."""

    def __init__(self, model_dir: str):
        from types import SimpleNamespace

        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor = SimpleNamespace(
            tokenizer=tokenizer, image_processor=AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        )
        self.image_token = tokenizer.image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)

    def __call__(self, messages: list[dict], images: list[Image.Image]) -> dict:
        tokenizer, image_processor = self.processor.tokenizer, self.processor.image_processor
        text = tokenizer.apply_chat_template(_hf_messages(messages), add_generation_prompt=True, tokenize=False)
        vision = {}
        if images:
            vision = dict(image_processor(images=images, return_tensors="pt"))
            merge = image_processor.merge_size
            parts = text.split(self.image_token)
            assert len(parts) == len(images) + 1, "one image token per image"
            counts = [int(grid.prod()) // (merge * merge) for grid in vision["image_grid_thw"]]
            text = parts[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, parts[1:]))
        encoded = tokenizer(text, return_tensors="pt")
        mm_token_type_ids = (encoded["input_ids"] == self.image_token_id).int()
        return {**encoded, **vision, "mm_token_type_ids": mm_token_type_ids}

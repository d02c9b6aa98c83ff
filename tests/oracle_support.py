"""The correctness oracle: ``transformers`` ``generate()`` on the full checkpoint."""

from __future__ import annotations

import base64
import io
import threading

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


class Oracle:
    """Greedy reference tokens from ``LlavaForConditionalGeneration.generate``."""

    def __init__(self, model_dir: str):
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.lock = threading.Lock()

    def generate(self, messages: list[dict], images: list[Image.Image], max_tokens: int) -> list[int]:
        hf_messages = []
        for message in messages:
            content = message["content"]
            if isinstance(content, list):
                content = [
                    {"type": "image"} if part["type"] == "image_url" else {"type": "text", "text": part["text"]}
                    for part in content
                ]
            hf_messages.append({"role": message["role"], "content": content})
        text = self.processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=text, images=images or None, return_tensors="pt")
        with self.lock, torch.inference_mode():
            output = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        return output[0, inputs["input_ids"].shape[1]:].tolist()

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.tokenizer.decode(token_ids, skip_special_tokens=True)

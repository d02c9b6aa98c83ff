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


def whole_and_halves(adapter, device: torch.device) -> tuple:
    """The whole model and its vision and LM halves (float32), checked to hold exactly the whole's weights."""
    from services.common.models import count_parameters

    full = adapter.load_full_model(device, torch.float32)
    vision = adapter.load_vision(device, torch.float32)
    lm = adapter.load_language_model(device, torch.float32)
    assert count_parameters(vision) == count_parameters(full.model.visual)
    assert count_parameters(vision) + count_parameters(lm) == count_parameters(full)
    return full, vision, lm


def encode_three_grids(adapter, vision, full, device: torch.device) -> tuple:
    """Three images of different grids through the vision half (one packed forward) and through the whole
    model's ``get_image_features``: (the processed images, the half's rows per image, the whole's output)."""
    from services.common.models import encode_images

    image_processor = adapter.load_processor().image_processor
    images = [
        adapter.process_image(image_processor, make_image(k, size))
        for k, size in enumerate([(96, 32), (32, 80), (64, 64)])
    ]
    pixels = [torch.from_numpy(i.pixel_values) for i in images]
    ours = encode_images(vision, [(p, i.patch_grid) for p, i in zip(pixels, images)], device, torch.float32)
    with torch.no_grad():
        reference = full.model.get_image_features(torch.cat(pixels), torch.tensor([i.patch_grid for i in images]))
    return images, ours, reference


def _hf_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages in the chat template's form (image parts lose their URL)."""
    hf_messages = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            kinds = {"image_url": "image", "video_url": "video"}
            content = [
                {"type": kinds[part["type"]]} if part["type"] in kinds else {"type": "text", "text": part["text"]}
                for part in content
            ]
        hf_messages.append({"role": message["role"], "content": content})
    return hf_messages


class Oracle:
    """Greedy reference tokens from the full checkpoint's ``generate()`` (LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForImageTextToText

        self.model_dir = Path(model_dir)
        self.model_type = json.loads((self.model_dir / "config.json").read_text())["model_type"]
        self.inputs = _LlavaInputs(model_dir) if self.model_type == "llava" else _QwenInputs(model_dir)
        self.processor = self.inputs.processor
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.lock = threading.Lock()

    def prompt_ids(self, messages: list[dict], images: list[Image.Image]) -> list[int]:
        """The prompt's token ids, image placeholders expanded, as ``generate()`` sees them."""
        return self.inputs(messages, images)["input_ids"][0].tolist()

    def generate(
        self, messages: list[dict], images: list[Image.Image], max_tokens: int, videos: list | None = None, **options
    ) -> list[int]:
        """Greedy new tokens; ``options`` go to ``generate()`` (e.g. ``min_new_tokens``, ``eos_token_id``);
        ``videos``: ``video_support.ReferenceVideo`` each, in prompt order (Qwen only)."""
        inputs = self.inputs(messages, images, videos) if videos else self.inputs(messages, images)
        if self.model_type != "qwen2_5_vl":
            inputs.pop("second_per_grid_ts", None)  # Qwen2-VL spaces video frames by one position
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
        self.video_token = tokenizer.video_token
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    def _qwen3_video(self, video, merge: int) -> str:
        """``Qwen3VLProcessor.replace_video_token``'s text for one video."""
        per_frame = int(video.grid[1:].prod()) // (merge * merge)
        return "".join(
            f"<{seconds:.1f} seconds><|vision_start|>{self.video_token * per_frame}<|vision_end|>"
            for seconds in video.timestamps
        )

    def __call__(self, messages: list[dict], images: list[Image.Image], videos: list | None = None) -> dict:
        tokenizer, image_processor = self.processor.tokenizer, self.processor.image_processor
        text = tokenizer.apply_chat_template(_hf_messages(messages), add_generation_prompt=True, tokenize=False)
        merge = image_processor.merge_size
        vision = {}
        if images:
            vision = dict(image_processor(images=images, return_tensors="pt"))
            counts = [int(grid.prod()) // (merge * merge) for grid in vision["image_grid_thw"]]
            text = _repeat(text, self.image_token, counts)
        if videos:
            # transformers' own Qwen2-VL video processor needs torchvision (not installed): the frames come
            # from video_support's independent implementation of its rules.
            vision["pixel_values_videos"] = torch.cat([video.pixel_values for video in videos])
            vision["video_grid_thw"] = torch.stack([video.grid for video in videos])
            vision["second_per_grid_ts"] = torch.tensor([video.second_per_grid_t for video in videos])
            counts = [int(video.grid.prod()) // (merge * merge) for video in videos]
            if videos[0].timestamps is None:
                text = _repeat(text, self.video_token, counts)
            else:  # Qwen3-VL: each temporal patch after its timestamp, between the vision markers
                text = _replace(text, self.video_token, [self._qwen3_video(video, merge) for video in videos])
        encoded = tokenizer(text, return_tensors="pt")
        ids = encoded["input_ids"]
        mm_token_type_ids = (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int()
        return {**encoded, **vision, "mm_token_type_ids": mm_token_type_ids}


def _replace(text: str, token: str, replacements: list[str]) -> str:
    """Each occurrence of ``token`` replaced by ``replacements[i]``."""
    parts = text.split(token)
    assert len(parts) == len(replacements) + 1, "one placeholder per item"
    return parts[0] + "".join(new + rest for new, rest in zip(replacements, parts[1:]))


def _repeat(text: str, token: str, counts: list[int]) -> str:
    """Each occurrence of ``token`` repeated ``counts[i]`` times."""
    parts = text.split(token)
    assert len(parts) == len(counts) + 1, "one placeholder per item"
    return parts[0] + "".join(token * n + rest for n, rest in zip(counts, parts[1:]))

"""LLaVA-style checkpoints: CLIP/SigLIP vision tower + MLP projector + a Llama-family causal LM."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import (
    AutoModelForCausalLM,
    AutoProcessor,
    AutoTokenizer,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
)

from .adapter import ModelAdapter, ProcessedImage, eos_token_ids, pixel_settings, read_json, tied_head
from .loading import Part, SafetensorsCheckpoint, load_part
from .source import CONFIG_PATTERNS, PROCESSOR_PATTERNS, WEIGHT_PATTERNS, CheckpointSource
from .vision import VisionEncoder
from .vision_io import PixelLayout


class LlavaAdapter(ModelAdapter):
    """LLaVA-style models: every image is resized to one size and becomes a fixed number of tokens."""

    family = "llava"

    def __init__(self, source: CheckpointSource, config: LlavaConfig):
        self.source = source
        self.config = config
        text_config = config.text_config
        self.model_id = source.model_id
        self.image_token_id = config.image_token_id
        self.hidden_size = text_config.hidden_size
        self.max_model_len = text_config.max_position_embeddings
        config_dir = source.directory(CONFIG_PATTERNS)
        self.image_token = read_json(config_dir / "processor_config.json").get("image_token", "<image>")
        self.eos_token_ids = eos_token_ids(config_dir, text_config.eos_token_id)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    @functools.cached_property
    def _processor(self) -> Any:
        """Private shared instance for read-only questions (token counts, settings)."""
        return self.load_processor()

    def num_image_tokens(self, height: int, width: int) -> int:
        processor = self._processor
        kwargs = {}
        if getattr(processor.image_processor, "crop_size", None) is None:
            # SigLIP resizes to a fixed size and does not crop: the input size is its size.
            size = processor.image_processor.size
            kwargs["crop_size"] = {"height": size["height"], "width": size["width"]}
        counts = processor._get_num_multimodal_tokens(image_sizes=[(height, width)], **kwargs)
        return int(counts.num_image_tokens[0])

    def process_image(self, image_processor: Any, image: Any) -> ProcessedImage:
        pixels = image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
        return ProcessedImage(pixels.to(torch.float32).contiguous(), self.num_image_tokens(image.height, image.width))

    def pixel_layout(self) -> PixelLayout:
        return PixelLayout()

    def processor_settings(self) -> dict[str, Any]:
        return pixel_settings(self._processor.image_processor)

    def load_processor(self) -> Any:
        return AutoProcessor.from_pretrained(self.source.directory(PROCESSOR_PATTERNS))

    def load_tokenizer(self) -> Any:
        return AutoTokenizer.from_pretrained(self.source.directory(PROCESSOR_PATTERNS))

    def _weights(self) -> SafetensorsCheckpoint:
        return SafetensorsCheckpoint(self.source.directory(WEIGHT_PATTERNS))

    def load_vision(self, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
        with init_empty_weights():
            encoder = VisionEncoder(self.config)
        parts = {"vision_tower": Part.VISION_TOWER, "multi_modal_projector": Part.PROJECTOR}
        load_part(encoder, self._weights(), parts, torch.device(device), dtype)
        return encoder.eval().requires_grad_(False)

    def load_language_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        with init_empty_weights():  # a copy: from_config records attention/dtype choices on its config
            model = AutoModelForCausalLM.from_config(copy.deepcopy(self.config.text_config), dtype=dtype)
        tied = self.config.tie_word_embeddings or self.config.text_config.tie_word_embeddings
        load_part(
            model,
            self._weights(),
            {"": Part.LANGUAGE_MODEL},
            torch.device(device),
            dtype,
            derive=functools.partial(tied_head, tied=tied),
        )
        return model.eval().requires_grad_(False)

    def load_full_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        directory = self.source.directory(WEIGHT_PATTERNS + PROCESSOR_PATTERNS)
        model = LlavaForConditionalGeneration.from_pretrained(directory, dtype=dtype)
        return model.to(device).eval()

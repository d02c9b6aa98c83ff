"""LLaVA-style checkpoints, the torch-free half: configs, processor, placeholder counts, numpy pixels."""

from __future__ import annotations

import functools
from typing import Any

from transformers import AutoProcessor, AutoTokenizer, LlavaConfig, PreTrainedConfig

from .configs import text_config_of
from .pixel_layout import PixelLayout
from .processing import (
    ModelProcessing,
    ProcessedImage,
    eos_token_ids,
    float32_pixels,
    pixel_settings,
    read_json,
)
from .source import CONFIG_PATTERNS, PROCESSOR_PATTERNS, CheckpointSource


class LlavaProcessing(ModelProcessing):
    """LLaVA-style models: every image is resized to one size and becomes a fixed number of tokens."""

    family = "llava"

    def __init__(self, source: CheckpointSource, config: LlavaConfig):
        self.source = source
        self.config = config
        text_config = self.text_config
        self.model_id = source.model_id
        self.image_token_id = config.image_token_id
        self.hidden_size = text_config.hidden_size
        self.max_model_len = text_config.max_position_embeddings
        config_dir = source.directory(CONFIG_PATTERNS)
        self._image_token: str = read_json(config_dir / "processor_config.json").get("image_token", "<image>")
        self.eos_token_ids = eos_token_ids(config_dir, text_config.eos_token_id)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def image_token(self) -> str:
        return self._image_token

    @property
    def text_config(self) -> PreTrainedConfig:
        """The LM's config."""
        return text_config_of(self.config)

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
        # numpy, not torch: the same float32 values, and the proxy needs no torch for them.
        pixels = image_processor(images=[image], return_tensors="np")["pixel_values"][0]
        return ProcessedImage(float32_pixels(pixels), self.num_image_tokens(image.height, image.width))

    def pixel_layout(self) -> PixelLayout:
        return PixelLayout()

    def processor_settings(self) -> dict[str, Any]:
        return pixel_settings(self._processor.image_processor)

    def load_processor(self) -> Any:
        return AutoProcessor.from_pretrained(self.source.directory(PROCESSOR_PATTERNS))

    def load_tokenizer(self) -> Any:
        return AutoTokenizer.from_pretrained(self.source.directory(PROCESSOR_PATTERNS))

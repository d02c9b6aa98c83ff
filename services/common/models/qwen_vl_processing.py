"""Qwen2-VL and Qwen2.5-VL checkpoints, the torch-free half: configs, processor, grids, numpy patches.

An image keeps its aspect ratio: the processor resizes it to a multiple of
``patch_size * merge_size`` with a pixel count within ``min_pixels`` /
``max_pixels`` and cuts it into patches; its token count is ``t * h * w /
merge_size**2`` for its patch grid ``(t, h, w)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from transformers import AutoImageProcessor, AutoTokenizer, PreTrainedConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from .configs import text_config_of
from .pixel_layout import PixelLayout
from .processing import (
    ImageShape,
    ModelProcessing,
    ProcessedImage,
    UnsupportedImageError,
    eos_token_ids,
    float32_pixels,
    pixel_settings,
)
from .qwen_video import VideoBounds, video_bounds, video_grid, video_patches
from .source import CONFIG_PATTERNS, PROCESSOR_PATTERNS, CheckpointSource

# The patch count a tower accepts, relative to what the processor's max_pixels
# allows: smart_resize may exceed max_pixels for very elongated images.
MAX_PATCHES_SLACK = 4

_SHAPE_REFUSED = "The image's aspect ratio is too extreme for this model (at most 200:1)."


@dataclass(frozen=True)
class QwenProcessor:
    """What the proxy needs of a Qwen checkpoint's processor: the tokenizer (it holds the chat
    template) and the image processor. transformers' processor class also needs a video
    processor, which cannot be built without torchvision; images need only these two."""

    tokenizer: Any
    image_processor: Any

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)


class QwenVLProcessing(ModelProcessing):
    """Qwen2-VL / Qwen2.5-VL: dynamic resolution, 3-D rotary positions, grids on the wire."""

    uses_mrope = True
    supports_video = True

    def __init__(self, source: CheckpointSource, config: Any):
        self.source = source
        self.config = config
        self.family = config.model_type
        text_config = self.text_config
        self.model_id = source.model_id
        self.image_token_id = config.image_token_id
        self.video_token_id = config.video_token_id
        # Qwen2.5-VL spaces a video's temporal positions by this many per second; Qwen2-VL by one per patch.
        self.tokens_per_second = getattr(config.vision_config, "tokens_per_second", None)
        self.hidden_size = text_config.hidden_size
        self.max_model_len = text_config.max_position_embeddings
        self.eos_token_ids = eos_token_ids(source.directory(CONFIG_PATTERNS), text_config.eos_token_id)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def text_config(self) -> PreTrainedConfig:
        """The LM's config."""
        return text_config_of(self.config)

    @functools.cached_property
    def _processor(self) -> QwenProcessor:
        """Private shared instance for read-only questions (token counts, settings)."""
        return self.load_processor()

    @property
    def image_token(self) -> str:
        return self._processor.tokenizer.convert_ids_to_tokens(self.image_token_id)

    @property
    def merge_size(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    def num_image_tokens(self, height: int, width: int) -> int:
        try:
            patches = self._processor.image_processor.get_number_of_image_patches(height, width)
        except ValueError:
            raise UnsupportedImageError(_SHAPE_REFUSED) from None
        return patches // (self.merge_size * self.merge_size)

    def process_image(self, image_processor: Any, image: Any) -> ProcessedImage:
        try:
            # numpy, not torch: the same float32 values, and the proxy needs no torch for them.
            out = image_processor(images=[image], return_tensors="np")
        except ValueError:  # smart_resize refuses aspect ratios above 200:1
            raise UnsupportedImageError(_SHAPE_REFUSED) from None
        t, h, w = (int(n) for n in out["image_grid_thw"][0])
        merge = self.merge_size
        return ProcessedImage(
            pixel_values=float32_pixels(out["pixel_values"]),  # [t*h*w, C*T*P*P]
            num_tokens=t * h * w // (merge * merge),
            patch_grid=(t, h, w),
            token_grid=(t, h // merge, w // merge),
        )

    def image_shape(self, height: int, width: int) -> ImageShape:
        """The processor's resize rule (``smart_resize``) applied to the size alone."""
        processor = self._processor.image_processor
        try:
            height, width = smart_resize(
                height,
                width,
                factor=processor.patch_size * self.merge_size,
                min_pixels=processor.size["shortest_edge"],
                max_pixels=processor.size["longest_edge"],
            )
        except ValueError:  # aspect ratios above 200:1
            raise UnsupportedImageError(_SHAPE_REFUSED) from None
        merge, patch = self.merge_size, processor.patch_size
        return ImageShape(
            num_tokens=(height // patch) * (width // patch) // (merge * merge),
            patch_grid=(1, height // patch, width // patch),
            token_grid=(1, height // patch // merge, width // patch // merge),
        )

    @functools.cached_property
    def video_bounds(self) -> VideoBounds:
        """Pixels each video frame is resized within."""
        return video_bounds(self.source.directory(PROCESSOR_PATTERNS), self._processor.image_processor)

    def video_shape(self, num_frames: int, height: int, width: int) -> ImageShape:
        """Tokens and grids of ``num_frames`` sampled frames of this size, without their pixels."""
        processor = self._processor.image_processor
        try:
            t, h, w = video_grid(num_frames, height, width, self.video_bounds, processor)
        except ValueError:
            raise UnsupportedImageError(_SHAPE_REFUSED) from None
        merge = self.merge_size
        return ImageShape(t * h * w // (merge * merge), (t, h, w), (t, h // merge, w // merge))

    def process_video(self, image_processor: Any, frames: list[Any]) -> ProcessedImage:
        """Sampled RGB frames of one video through the image processor's rules (``qwen_video``)."""
        try:
            pixels, (t, h, w) = video_patches(image_processor, frames, self.video_bounds)
        except ValueError:
            raise UnsupportedImageError(_SHAPE_REFUSED) from None
        merge = self.merge_size
        return ProcessedImage(pixels, t * h * w // (merge * merge), (t, h, w), (t, h // merge, w // merge))

    def pixel_layout(self) -> PixelLayout:
        vision = self.config.vision_config
        image_processor = self._processor.image_processor
        max_pixels = image_processor.size["longest_edge"]
        return PixelLayout(
            patch_dim=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
            merge_size=self.merge_size,
            max_patches=MAX_PATCHES_SLACK * max_pixels // image_processor.patch_size**2,
        )

    def processor_settings(self) -> dict[str, Any]:
        extra = ("patch_size", "temporal_patch_size", "merge_size")
        return pixel_settings(self._processor.image_processor, extra)

    def load_processor(self) -> QwenProcessor:
        directory = self.source.directory(PROCESSOR_PATTERNS)
        # The PIL backend everywhere, so pixels (and mm_hash) do not depend on whether torchvision is installed.
        return QwenProcessor(self.load_tokenizer(), AutoImageProcessor.from_pretrained(directory, backend="pil"))

    def load_tokenizer(self) -> Any:
        return AutoTokenizer.from_pretrained(self.source.directory(PROCESSOR_PATTERNS))

"""Qwen3-VL checkpoints (dense and MoE), the torch-free half: what differs from Qwen2.5-VL's.

Images are processed as Qwen2-VL's (the checkpoint's image processor: 16-pixel
patches, mean and std 0.5). What differs:

- ``num_deepstack_levels``: an image's embedding carries that many DeepStack
  feature rows per token besides its own row (``EmbeddingHeader.num_deepstack_levels``);
- videos follow Qwen3-VL's video processor (``qwen3_video``): its frame
  sampling, one size for the whole clip, and a prompt that gives each temporal
  patch its own run of placeholders after a ``<t seconds>`` timestamp
  (``video_frame_texts``), each run positioned as an image of one frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .pixel_layout import PixelLayout
from .processing import ImageShape, ProcessedImage, TooFewFramesError, UnsupportedImageError
from .qwen3_video import clip_patches, frame_timestamps, timestamp_text, video_grid
from .qwen_vl_processing import MAX_PATCHES_SLACK, QwenVLProcessing
from .source import CheckpointSource

_VIDEO_REFUSED = "The video is too short (fewer frames than a temporal patch) or its aspect ratio is too extreme."
_TOO_FEW_FRAMES = "The video has too few frames to sample."


class Qwen3VLProcessing(QwenVLProcessing):
    """Qwen3-VL / Qwen3-VL-MoE: Qwen2.5-VL's processing with DeepStack rows and Qwen3-VL's videos."""

    video_sampling_rule = "qwen3_vl"

    def __init__(self, source: CheckpointSource, config: Any):
        super().__init__(source, config)
        self.num_deepstack_levels = len(config.vision_config.deepstack_visual_indexes)
        self.vision_start_token_id = int(config.vision_start_token_id)
        self.vision_end_token_id = int(config.vision_end_token_id)

    def video_shape(self, num_frames: int, height: int, width: int) -> ImageShape:
        processor = self._processor.image_processor
        if num_frames < processor.temporal_patch_size:  # the same refusal as a clip too short to sample
            raise TooFewFramesError(_TOO_FEW_FRAMES)
        try:
            t, h, w = video_grid(num_frames, height, width, self.video_bounds, processor)
        except ValueError:
            raise UnsupportedImageError(_VIDEO_REFUSED) from None
        merge = self.merge_size
        return ImageShape(t * h * w // (merge * merge), (t, h, w), (t, h // merge, w // merge))

    def process_video(self, image_processor: Any, frames: list[Any]) -> ProcessedImage:
        try:
            pixels, (t, h, w) = clip_patches(image_processor, frames, self.video_bounds)
        except ValueError:
            raise UnsupportedImageError(_VIDEO_REFUSED) from None
        merge = self.merge_size
        return ProcessedImage(pixels, t * h * w // (merge * merge), (t, h, w), (t, h // merge, w // merge))

    def video_frame_texts(self, indices: Sequence[int], fps: float) -> tuple[tuple[str, str], ...]:
        """Per temporal patch, the text before and after its placeholders: the timestamp and the
        vision markers, as ``Qwen3VLProcessor.replace_video_token`` writes them."""
        tokenizer = self._processor.tokenizer
        start = tokenizer.convert_ids_to_tokens(self.vision_start_token_id)
        end = tokenizer.convert_ids_to_tokens(self.vision_end_token_id)
        temporal = int(self._processor.image_processor.temporal_patch_size)
        return tuple((timestamp_text(seconds) + start, end) for seconds in frame_timestamps(indices, fps, temporal))

    def pixel_layout(self) -> PixelLayout:
        # A clip's budget covers all its frames: one frame of a short clip may exceed an image's.
        layout = super().pixel_layout()
        per_frame = self.video_bounds.max_pixels // int(self._processor.image_processor.temporal_patch_size)
        patch = int(self._processor.image_processor.patch_size)
        return PixelLayout(
            patch_dim=layout.patch_dim,
            merge_size=layout.merge_size,
            max_patches=max(layout.max_patches, MAX_PATCHES_SLACK * per_frame // patch**2),
        )

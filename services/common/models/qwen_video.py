"""Qwen2-VL / Qwen2.5-VL videos without torchvision: sampled frames -> patches, grid, seconds per patch.

transformers' Qwen2-VL video processor is built on torchvision, which the
services do not install. Its rules are applied here with the checkpoint's
(PIL-backed) image processor: every sampled frame is resized to the same
multiple of ``patch_size * merge_size`` with a pixel count within the video
bounds (``video_preprocessor_config.json``'s, else the image processor's),
rescaled and normalised; the frame count is padded to a multiple of
``temporal_patch_size`` by repeating the last frame; consecutive frames pair
up into temporal patches, laid out as the video processor's ``patchify``:
rows ``(t, h/m, w/m, m, m)``, columns ``(C, T, P, P)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from .pixel_layout import Grid
from .processing import read_json


@dataclass(frozen=True)
class VideoBounds:
    """Pixels a frame is resized within (``smart_resize``'s min/max)."""

    min_pixels: int
    max_pixels: int


def video_bounds(directory: Path, image_processor: Any) -> VideoBounds:
    """The checkpoint's video bounds: its video processor config's size, else the image processor's."""
    config = read_json(directory / "video_preprocessor_config.json")
    size = config.get("size") or {}
    min_pixels = config.get("min_pixels") or size.get("shortest_edge") or image_processor.size["shortest_edge"]
    max_pixels = config.get("max_pixels") or size.get("longest_edge") or image_processor.size["longest_edge"]
    return VideoBounds(int(min_pixels), int(max_pixels))


def frame_size(height: int, width: int, bounds: VideoBounds, factor: int) -> tuple[int, int]:
    """``(height, width)`` a frame is resized to; ValueError for aspect ratios over 200:1."""
    return smart_resize(height, width, factor=factor, min_pixels=bounds.min_pixels, max_pixels=bounds.max_pixels)


def video_grid(num_frames: int, height: int, width: int, bounds: VideoBounds, processor: Any) -> Grid:
    """The patch grid ``(t, h, w)`` of ``num_frames`` sampled frames of this size."""
    patch, temporal = processor.patch_size, processor.temporal_patch_size
    resized_h, resized_w = frame_size(height, width, bounds, patch * processor.merge_size)
    return (-(-num_frames // temporal), resized_h // patch, resized_w // patch)


def video_patches(processor: Any, frames: Sequence[Any], bounds: VideoBounds) -> tuple[np.ndarray, Grid]:
    """Sampled RGB frames (PIL, one size) -> float32 patches ``[t*h*w, C*T*P*P]`` and their grid."""
    size = {"shortest_edge": bounds.min_pixels, "longest_edge": bounds.max_pixels}
    return _patches(processor, processor(images=list(frames), size=size, return_tensors="np"), len(frames))


def resized_patches(processor: Any, frames: Sequence[Any]) -> tuple[np.ndarray, Grid]:
    """``video_patches`` of frames already resized to a multiple of ``patch_size * merge_size``."""
    return _patches(processor, processor(images=list(frames), do_resize=False, return_tensors="np"), len(frames))


def _patches(processor: Any, out: Any, num_frames: int) -> tuple[np.ndarray, Grid]:
    """The image processor's output for each frame -> the video's patches, as ``video_patches`` lays them out."""
    _, h, w = (int(n) for n in out["image_grid_thw"][0])
    temporal, patch = processor.temporal_patch_size, processor.patch_size
    # The image processor repeats each frame over the temporal axis; keep one copy of each.
    per_frame = out["pixel_values"].reshape(num_frames, h * w, -1, temporal, patch, patch)[:, :, :, 0]
    if pad := -num_frames % temporal:
        per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, axis=0)])
    t = per_frame.shape[0] // temporal
    # [t, T, hw, C, P, P] -> [t, hw, C, T, P, P]: a patch holds T consecutive frames, channel-major.
    paired = per_frame.reshape(t, temporal, h * w, -1, patch, patch).transpose(0, 2, 3, 1, 4, 5)
    return np.ascontiguousarray(paired.reshape(t * h * w, -1), dtype=np.float32), (t, h, w)

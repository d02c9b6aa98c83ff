"""Qwen3-VL videos without torchvision: frame size, patches and the timestamps its prompt carries.

transformers' ``Qwen3VLVideoProcessor`` needs torchvision; its rules are
written out here (torch-free: the proxy uses them too):

- frames are sampled by ``video_files.sample_indices``' ``qwen3_vl`` rule;
- every frame is resized to one size that ``smart_resize`` picks over the
  whole clip (the pixel budget counts frames x height x width, the temporal
  count rounded to the temporal patch size), with PIL's bicubic filter, then
  rescaled, normalised and cut into patches as an image (``qwen_video``);
- the prompt gives each temporal patch its own run of placeholders, after
  the text ``<{seconds:.1f} seconds>`` and between the vision markers: the
  seconds are the mean of the first and last sampled frame's time in the
  patch (``Qwen3VLProcessor._calculate_timestamps``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from .pixel_layout import Grid
from .qwen_video import VideoBounds, resized_patches


def smart_resize(
    num_frames: int, height: int, width: int, *, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """``(height, width)`` every frame of a ``num_frames`` clip is resized to (transformers' Qwen3-VL
    ``smart_resize``); ValueError for fewer frames than a temporal patch or an aspect ratio over 200:1."""
    if num_frames < temporal_factor:
        raise ValueError(f"a video needs at least {temporal_factor} frames")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_size(num_frames: int, height: int, width: int, bounds: VideoBounds, processor: Any) -> tuple[int, int]:
    """The size a clip's frames are resized to, under the video bounds and the processor's patch sizes."""
    return smart_resize(
        num_frames,
        height,
        width,
        temporal_factor=processor.temporal_patch_size,
        factor=processor.patch_size * processor.merge_size,
        min_pixels=bounds.min_pixels,
        max_pixels=bounds.max_pixels,
    )


def video_grid(num_frames: int, height: int, width: int, bounds: VideoBounds, processor: Any) -> Grid:
    """The patch grid ``(t, h, w)`` of ``num_frames`` sampled frames of this size."""
    resized_h, resized_w = frame_size(num_frames, height, width, bounds, processor)
    patch = processor.patch_size
    return (-(-num_frames // processor.temporal_patch_size), resized_h // patch, resized_w // patch)


def clip_patches(processor: Any, frames: Sequence[Image.Image], bounds: VideoBounds) -> tuple[np.ndarray, Grid]:
    """Sampled RGB frames (PIL, one size) -> float32 patches ``[t*h*w, C*T*P*P]`` and their grid."""
    size = frame_size(len(frames), frames[0].height, frames[0].width, bounds, processor)
    return resized_patches(processor, [frame.resize(size[::-1], Image.Resampling.BICUBIC) for frame in frames])


def frame_timestamps(indices: Sequence[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time (the last frame
    repeated to fill the final patch)."""
    padded = list(indices)
    if pad := -len(padded) % temporal_patch_size:
        padded += [padded[-1]] * pad
    seconds = [index / fps for index in padded]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)
    ]


def timestamp_text(seconds: float) -> str:
    """The text before a temporal patch's placeholders."""
    return f"<{seconds:.1f} seconds>"

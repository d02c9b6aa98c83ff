"""The pixels of one ``EncodeItem``, validated: the encoder's and the colocated PD's one reading of the wire.

An item carries either ``pixel_values`` (processed by the checkpoint's image
processor, float) or ``image_file`` (the client's image file, which the
vision side decodes under the proxy's rules, processes and hashes itself:
the same pixels from far fewer bytes, under an ``mm_hash`` it has checked),
or a video: ``video_file`` or ``frame_files``, with ``video_sampling``
(``video_items``), sampled, processed and hashed the same way.
Errors name the item and the rule, never the values.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from services.common import image_files, tensors, video_items
from services.common.grids import grid_from_pb
from services.common.hashing import hash_settings, mm_hash
from services.common.models.pixel_layout import Grid, PixelLayout
from services.common.pb import epd_pb2
from services.common.video_files import NO_BUDGET, DecodeBudget, VideoLimits

MAX_FILE_PIXELS = 8192 * 8192
"""Largest image file a vision side decodes (the proxy's own cap, ``--max-image-pixels``, is lower by default)."""


class ProcessFile(Protocol):
    """Image files (called) and videos (``video``) -> processed pixels, patch grid and ``mm_hash``."""

    def __call__(self, data: bytes, cache_salt: str) -> tuple[np.ndarray, Grid | None, str]: ...

    def video(
        self, item: epd_pb2.EncodeItem, cache_salt: str, budget: DecodeBudget = NO_BUDGET
    ) -> tuple[np.ndarray, Grid, str]: ...


VIDEO_LIMITS = VideoLimits()
"""What a vision side decodes of one video by default: the proxy's defaults (``--max-video-*`` on both)."""


class _FileProcessor:
    """``file_processor``'s result: the adapter's processors and hashing, for image files and videos."""

    def __init__(self, adapter: Any, image_processor: Any, video_limits: VideoLimits) -> None:
        self.adapter = adapter
        self.image_processor = image_processor
        self.settings = adapter.processor_settings()
        self.video_limits = video_limits

    def __call__(self, data: bytes, cache_salt: str) -> tuple[np.ndarray, Grid | None, str]:
        with image_files.decoded(data, _max_file_pixels()) as image:
            processed = self.adapter.process_image(self.image_processor, image)
            digest = mm_hash(
                image, hash_settings(self.settings, processed.patch_grid), self.adapter.model_id, cache_salt
            )
        return processed.pixel_values, processed.patch_grid, digest

    def video(
        self, item: epd_pb2.EncodeItem, cache_salt: str, budget: DecodeBudget = NO_BUDGET
    ) -> tuple[np.ndarray, Grid, str]:
        if not getattr(self.adapter, "supports_video", False):
            raise ValueError("this model takes no videos")
        temporal = int(self.image_processor.temporal_patch_size)
        limits = self.video_limits
        sampling = video_items.sampling_from_pb(item.video_sampling, temporal, limits, self.adapter.video_sampling_rule)
        video = video_items.sample_video(item.video_file, item.frame_files, sampling, limits, budget)
        try:
            processed = self.adapter.process_video(self.image_processor, video.frames)
            grid = processed.patch_grid
            digest = video_items.hash_video(
                video,
                self.settings,
                sampling,
                grid,
                self.adapter.model_id,
                cache_salt,
                frames_given=not item.video_file,
            )
        finally:
            video.close()
        return processed.pixel_values, grid, digest


def file_processor(adapter: Any, image_processor: Any, video_limits: VideoLimits = VIDEO_LIMITS) -> ProcessFile:
    """Decodes an image file (``image_files``, at most ``MAX_FILE_PIXELS``) or a video (``video_items``, within
    ``video_limits``), runs ``adapter``'s processor on it and hashes it as the proxy does; ValueError for a file
    it refuses, ``DecodeStopped`` when a video's budget ends. CPU work: call it off the event loop."""
    return _FileProcessor(adapter, image_processor, video_limits)


def has_video(request: epd_pb2.EncodeRequest) -> bool:
    """Whether any item of ``request`` is a video (decoded on ``video_decodes.VideoDecodes``)."""
    return any(item.video_file or item.frame_files for item in request.items)


def _max_file_pixels() -> int:
    return MAX_FILE_PIXELS


def item_pixels(
    item: epd_pb2.EncodeItem,
    index: int,
    layout: PixelLayout,
    process_file: ProcessFile | None = None,
    cache_salt: str = "",
    accept_pixel_values: bool = True,
    budget: DecodeBudget = NO_BUDGET,
) -> tuple[torch.Tensor, Grid | None]:
    """The processed pixels and patch grid of ``item``; ValueError unless they fit ``layout``.

    ``process_file`` is None where image files are not taken. It decodes and
    processes the image: call this off the event loop. An image file's
    ``mm_hash`` must be its hash under ``cache_salt`` (checked by the caller).
    ``accept_pixel_values``: whether processed pixels are taken at all; their
    ``mm_hash`` cannot be checked against them (it hashes the decoded image).
    ``budget``: when a video's decoding must stop (``DecodeStopped``, not a ValueError).
    """
    has_video = bool(item.video_file) or bool(item.frame_files)
    has_pixels, has_file = item.HasField("pixel_values"), bool(item.image_file)
    if has_pixels + has_file + has_video != 1 or (item.video_file and item.frame_files):
        raise ValueError(
            f"item {index}: exactly one of pixel_values, image_file, video_file and frame_files is required"
        )
    if has_pixels and not accept_pixel_values:
        raise ValueError(f"item {index}: send the image as image_file; this server does not take pixel_values")
    what = "pixel_values" if has_pixels else "image_file" if has_file else "video"
    try:
        grid = grid_from_pb(item)
        pixels = tensors.from_pb(item.pixel_values) if has_pixels else None
    except ValueError:
        raise ValueError(f"item {index}: {what} or grid is not valid") from None
    if pixels is None:
        pixels = _process(item, grid, index, process_file, cache_salt, has_video, budget)
    elif pixels.dtype not in tensors.PIXEL_DTYPES:
        raise ValueError(f"item {index}: pixel_values must be float32, float16 or bfloat16")
    try:
        layout.check(pixels, grid)
    except ValueError as error:
        raise ValueError(f"item {index}: {error}") from None
    if not layout.uses_grids and (pixels.dim() != 3 or pixels.shape[0] != 3 or 0 in pixels.shape):
        raise ValueError(f"item {index}: pixel_values must have shape [3, H, W]")
    if has_pixels and not bool(torch.isfinite(pixels).all()):
        raise ValueError(f"item {index}: pixel_values must be finite")
    return pixels, grid


def _process(
    item: epd_pb2.EncodeItem,
    grid: Grid | None,
    index: int,
    process_file: ProcessFile | None,
    cache_salt: str,
    is_video: bool,
    budget: DecodeBudget,
) -> torch.Tensor:
    what = "video" if is_video else "image_file"
    if process_file is None:
        raise ValueError(f"item {index}: {what} is not taken here; send pixel_values")
    file_grid: Grid | None
    try:
        if is_video:
            pixels, file_grid, digest = process_file.video(item, cache_salt, budget)
        else:
            pixels, file_grid, digest = process_file(item.image_file, cache_salt)
    except ValueError as error:  # image/video files' refusals, and the processor's (e.g. an extreme aspect ratio)
        raise ValueError(f"item {index}: {what}: {error}") from None
    if grid != file_grid:
        raise ValueError(f"item {index}: grid must be the patch grid of the {'video' if is_video else 'image'}")
    # The hash names the embedding in every cache downstream: one that is not this image's own would
    # plant this image's embedding under another image's name. Proxy and encoder hash alike only when
    # they serve the same checkpoint (its id and processor settings are in the hash) and the same
    # tenant's cache salt (a hash under another tenant's salt would be that tenant's entry).
    if item.mm_hash != digest:
        raise ValueError(
            f"item {index}: mm_hash is not the hash of the image under the request's cache_salt "
            "(same checkpoint as the proxy?)"
        )
    return torch.from_numpy(pixels)

"""The pixels of one ``EncodeItem``, validated: the encoder's and the colocated PD's one reading of the wire.

An item carries either ``pixel_values`` (processed by the checkpoint's image
processor, float) or ``image_file`` (the client's image file, which the
vision side decodes under the proxy's rules, processes and hashes itself:
the same pixels from far fewer bytes, under an ``mm_hash`` it has checked).
Errors name the item and the rule, never the values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from services.common import image_files, tensors
from services.common.grids import grid_from_pb
from services.common.hashing import hash_settings, mm_hash
from services.common.models.pixel_layout import Grid, PixelLayout
from services.common.pb import epd_pb2

MAX_FILE_PIXELS = 8192 * 8192
"""Largest image file a vision side decodes (the proxy's own cap, ``--max-image-pixels``, is lower by default)."""

ProcessFile = Callable[[bytes, str], tuple[np.ndarray, Grid | None, str]]
"""An image file and a cache salt -> its processed float32 pixels, patch grid and salted ``mm_hash``
(``file_processor``)."""


def file_processor(adapter: Any, image_processor: Any) -> ProcessFile:
    """Decodes an image file (``image_files``, at most ``MAX_FILE_PIXELS``), runs ``adapter``'s image
    processor on it and hashes it as the proxy does; ValueError for a file it refuses. CPU work: call it
    off the event loop."""
    settings = adapter.processor_settings()

    def process(data: bytes, cache_salt: str) -> tuple[np.ndarray, Grid | None, str]:
        with image_files.decoded(data, _max_file_pixels()) as image:
            processed = adapter.process_image(image_processor, image)
            digest = mm_hash(image, hash_settings(settings, processed.patch_grid), adapter.model_id, cache_salt)
        return processed.pixel_values, processed.patch_grid, digest

    return process


def _max_file_pixels() -> int:
    return MAX_FILE_PIXELS


def item_pixels(
    item: epd_pb2.EncodeItem,
    index: int,
    layout: PixelLayout,
    process_file: ProcessFile | None = None,
    cache_salt: str = "",
    accept_pixel_values: bool = True,
) -> tuple[torch.Tensor, Grid | None]:
    """The processed pixels and patch grid of ``item``; ValueError unless they fit ``layout``.

    ``process_file`` is None where image files are not taken. It decodes and
    processes the image: call this off the event loop. An image file's
    ``mm_hash`` must be its hash under ``cache_salt`` (checked by the caller).
    ``accept_pixel_values``: whether processed pixels are taken at all; their
    ``mm_hash`` cannot be checked against them (it hashes the decoded image).
    """
    has_pixels, has_file = item.HasField("pixel_values"), bool(item.image_file)
    if has_pixels == has_file:
        raise ValueError(f"item {index}: exactly one of pixel_values and image_file is required")
    if has_pixels and not accept_pixel_values:
        raise ValueError(f"item {index}: send the image as image_file; this server does not take pixel_values")
    what = "pixel_values" if has_pixels else "image_file"
    try:
        grid = grid_from_pb(item)
        pixels = tensors.from_pb(item.pixel_values) if has_pixels else None
    except ValueError:
        raise ValueError(f"item {index}: {what} or grid is not valid") from None
    if pixels is None:
        pixels = _process(item, grid, index, process_file, cache_salt)
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
    item: epd_pb2.EncodeItem, grid: Grid | None, index: int, process_file: ProcessFile | None, cache_salt: str
) -> torch.Tensor:
    if process_file is None:
        raise ValueError(f"item {index}: image_file is not taken here; send pixel_values")
    try:
        pixels, file_grid, digest = process_file(item.image_file, cache_salt)
    except ValueError as error:  # image_files' refusals, and the processor's (e.g. an extreme aspect ratio)
        raise ValueError(f"item {index}: image_file: {error}") from None
    if grid != file_grid:
        raise ValueError(f"item {index}: grid must be the patch grid of the image")
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

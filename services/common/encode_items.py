"""The pixels of one ``EncodeItem``, validated: the encoder's and the colocated PD's one reading of the wire.

An item carries either ``pixel_values`` (processed by the checkpoint's image
processor, float) or ``image`` (uint8 RGB ``[H, W, 3]`` resized by the
proxy, for towers whose processed pixels are much larger than the image);
the vision side finishes an ``image`` with the model's ``finish_image``.
Errors name the item and the rule, never the values.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.common import tensors
from services.common.grids import grid_from_pb
from services.common.models.pixel_layout import Grid, PixelLayout
from services.common.pb import epd_pb2

FinishImage = Callable[[np.ndarray], tuple[np.ndarray, Grid | None]]
"""A resized uint8 image -> its processed float32 pixels and patch grid (``ModelProcessing.finish_image``)."""


def item_pixels(
    item: epd_pb2.EncodeItem, index: int, layout: PixelLayout, finish: FinishImage | None = None
) -> tuple[torch.Tensor, Grid | None]:
    """The processed pixels and patch grid of ``item``; ValueError unless they fit ``layout``.

    ``finish`` is None for a model that takes only processed pixels. It runs
    the image processor: call this off the event loop.
    """
    has_pixels, has_image = item.HasField("pixel_values"), item.HasField("image")
    if has_pixels == has_image:
        raise ValueError(f"item {index}: exactly one of pixel_values and image is required")
    try:
        grid = grid_from_pb(item)
        pixels = tensors.from_pb(item.pixel_values if has_pixels else item.image)
    except ValueError:
        raise ValueError(f"item {index}: {'pixel_values' if has_pixels else 'image'} or grid is not valid") from None
    if has_image:
        pixels, grid = _finish(pixels, grid, index, finish)
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


def _finish(
    image: torch.Tensor, grid: Grid | None, index: int, finish: FinishImage | None
) -> tuple[torch.Tensor, Grid | None]:
    if finish is None:
        raise ValueError(f"item {index}: this model takes pixel_values, not a resized image")
    if image.dtype != torch.uint8:
        raise ValueError(f"item {index}: image must be uint8")
    try:
        pixels, finished_grid = finish(image.numpy())
    except ValueError as error:
        raise ValueError(f"item {index}: {error}") from None
    if grid != finished_grid:
        raise ValueError(f"item {index}: grid must be the patch grid of the image")
    return torch.from_numpy(pixels), grid

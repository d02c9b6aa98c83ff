"""What a vision half takes and how a batch of images runs through it (encoder and colocated PD).

Two kinds of vision modules exist:

- fixed-size towers (LLaVA): ``module(pixels [N, 3, H, W]) -> [N, tokens, hidden]``;
  only images of one pixel shape share a forward;
- dynamic-resolution towers (Qwen2-VL family, ``packs_grids = True``):
  ``module(patches [sum t*h*w, C*T*P*P], grid_thw [N, 3]) -> [sum tokens, hidden]``;
  images of any grids share one forward, packed (the tower attends within each
  image through its own ``cu_seqlens``).

``encode_images`` hides the difference: a list of (pixels, grid) in, one
``[num_tokens, hidden]`` embedding per image out; ``[num_tokens, 1 + levels,
hidden]`` for towers with DeepStack features (Qwen3-VL: ``num_deepstack_levels``
feature rows per token after its embedding row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from .pixel_layout import Grid, PixelLayout

# PixelLayout lives in the torch-free pixel_layout module (the proxy uses it); kept importable from here.
__all__ = ["Grid", "PixelLayout", "batch_key", "embedding_shape", "encode_images", "packs_grids"]


def packs_grids(module: torch.nn.Module) -> bool:
    """True for dynamic-resolution towers (one packed forward over any grids)."""
    return bool(getattr(module, "packs_grids", False))


def embedding_shape(num_tokens: int, hidden_size: int, num_deepstack_levels: int = 0) -> tuple[int, ...]:
    """The shape of one image's embedding: ``[num_tokens, hidden]``, with DeepStack levels
    ``[num_tokens, 1 + levels, hidden]`` (token-major: a run of tokens is one contiguous block)."""
    if num_deepstack_levels:
        return (num_tokens, 1 + num_deepstack_levels, hidden_size)
    return (num_tokens, hidden_size)


def batch_key(module: torch.nn.Module, pixels: torch.Tensor, grid: Grid | None) -> tuple:
    """Images with equal keys may share one ``encode_images`` call."""
    if packs_grids(module):
        return ("packed", pixels.dtype)
    return (tuple(pixels.shape), pixels.dtype, grid)


def encode_images(
    module: torch.nn.Module,
    images: Sequence[tuple[torch.Tensor, Grid | None]],
    device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One forward over ``images`` (pixels, grid); returns ``[num_tokens, hidden]`` (with DeepStack
    features ``[num_tokens, 1 + levels, hidden]``) per image.

    The results are views of one output tensor. Raises RuntimeError when the
    module's output does not have the shape the images call for.
    """
    with torch.inference_mode():
        if packs_grids(module):
            pixels = torch.cat([p for p, _ in images]).to(device=device, dtype=dtype)
            grids = _grids(images)
            # [sum tokens, hidden] or [sum tokens, 1 + levels, hidden]
            out = module(pixels, torch.tensor(grids, dtype=torch.long, device=device))
            merge = cast(
                int, module.spatial_merge_size
            )  # an int attribute; nn.Module's __getattr__ is typed for tensors
            sizes = [t * h * w // (merge * merge) for t, h, w in grids]
            if not isinstance(out, torch.Tensor) or out.dim() not in (2, 3) or out.shape[0] != sum(sizes):
                raise RuntimeError("vision module returned an unexpected output shape")
            return list(out.split(sizes))
        pixels = torch.stack([p for p, _ in images]).to(device=device, dtype=dtype)  # [N, 3, H, W]
        out = module(pixels)  # [N, tokens, hidden]
        if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[0] != len(images):
            raise RuntimeError("vision module returned an unexpected output shape")
        return list(out.unbind(0))


def _grids(images: Sequence[tuple[torch.Tensor, Grid | None]]) -> list[list[int]]:
    """The patch grids of images for a packed forward; ValueError if one has none (``PixelLayout.check`` requires them)."""
    grids = []
    for _, grid in images:
        if grid is None:
            raise ValueError("a dynamic-resolution vision module needs a grid for every image")
        grids.append(list(grid))
    return grids

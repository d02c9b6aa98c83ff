"""What a vision half takes and how a batch of images runs through it (encoder and colocated PD).

Two kinds of vision modules exist:

- fixed-size towers (LLaVA): ``module(pixels [N, 3, H, W]) -> [N, tokens, hidden]``;
  only images of one pixel shape share a forward;
- dynamic-resolution towers (Qwen2-VL family, ``packs_grids = True``):
  ``module(patches [sum t*h*w, C*T*P*P], grid_thw [N, 3]) -> [sum tokens, hidden]``;
  images of any grids share one forward, packed (the tower attends within each
  image through its own ``cu_seqlens``).

``encode_images`` hides the difference: a list of (pixels, grid) in, one
``[num_tokens, hidden]`` embedding per image out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class PixelLayout:
    """The pixel tensors a vision module takes; ``check`` refuses anything else before it is queued.

    ``patch_dim == 0``: whole images ``[3, H, W]`` and no grid. Otherwise
    flattened patches ``[t*h*w, patch_dim]`` with their patch grid ``(t, h, w)``,
    ``h`` and ``w`` multiples of ``merge_size``, at most ``max_patches`` rows (0 = no cap).
    """

    patch_dim: int = 0
    merge_size: int = 1
    max_patches: int = 0

    @property
    def uses_grids(self) -> bool:
        return self.patch_dim > 0

    def num_tokens(self, grid: Grid) -> int:
        """LM tokens of an image with this patch grid."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)

    def check(self, pixels: torch.Tensor, grid: Grid | None) -> None:
        """Raises ValueError (naming the rule, never the values) unless ``pixels``/``grid`` fit.

        For whole-image layouts only the grid's absence is checked here; the
        image shape rules live with the caller.
        """
        if not self.uses_grids:
            if grid is not None:
                raise ValueError("grid must not be set for this model")
            return
        if grid is None:
            raise ValueError("grid is required for this model")
        t, h, w = grid
        if min(grid) <= 0 or h % self.merge_size or w % self.merge_size:
            raise ValueError(f"grid must be positive with h and w multiples of {self.merge_size}")
        if self.max_patches and t * h * w > self.max_patches:
            raise ValueError(f"grid has more than {self.max_patches} patches")
        if pixels.dim() != 2 or tuple(pixels.shape) != (t * h * w, self.patch_dim):
            raise ValueError(f"pixel_values must have shape [t*h*w, {self.patch_dim}]")


def packs_grids(module: torch.nn.Module) -> bool:
    """True for dynamic-resolution towers (one packed forward over any grids)."""
    return bool(getattr(module, "packs_grids", False))


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
    """One forward over ``images`` (pixels, grid); returns ``[num_tokens, hidden]`` per image.

    The results are views of one output tensor. Raises RuntimeError when the
    module's output does not have the shape the images call for.
    """
    with torch.inference_mode():
        if packs_grids(module):
            pixels = torch.cat([p for p, _ in images]).to(device=device, dtype=dtype)
            grids = torch.tensor([list(g) for _, g in images], dtype=torch.long, device=device)
            out = module(pixels, grids)  # [sum tokens, hidden]
            merge = module.spatial_merge_size
            sizes = [t * h * w // (merge * merge) for t, h, w in (g for _, g in images)]
            if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != sum(sizes):
                raise RuntimeError("vision module returned an unexpected output shape")
            return list(out.split(sizes))
        pixels = torch.stack([p for p, _ in images]).to(device=device, dtype=dtype)  # [N, 3, H, W]
        out = module(pixels)  # [N, tokens, hidden]
        if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[0] != len(images):
            raise RuntimeError("vision module returned an unexpected output shape")
        return list(out.unbind(0))

"""The pixel arrays a vision half takes, checked without torch (the proxy's side and the services').

Pixels may be a ``torch.Tensor`` (encoder, colocated PD) or a numpy array
(proxy): only their shape is read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

Grid = tuple[int, int, int]


class Shaped(Protocol):
    """Anything with a shape: a ``torch.Tensor`` or a numpy array."""

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class PixelLayout:
    """The pixel tensors a vision module takes; ``check`` refuses anything else before it is queued.

    ``patch_dim == 0``: whole images ``[3, H, W]`` and no grid. Otherwise
    flattened patches ``[t*h*w, patch_dim]`` with their patch grid ``(t, h, w)``,
    ``h`` and ``w`` multiples of ``merge_size``, at most ``max_patches`` rows a
    frame (0 = no cap) and at most ``max_temporal`` temporal patches (videos).
    """

    patch_dim: int = 0
    merge_size: int = 1
    max_patches: int = 0
    max_temporal: int = 384  # 768 sampled frames in pairs: transformers' Qwen2-VL max_frames

    @property
    def uses_grids(self) -> bool:
        return self.patch_dim > 0

    def num_tokens(self, grid: Grid) -> int:
        """LM tokens of an image with this patch grid."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)

    def check(self, pixels: Shaped, grid: Grid | None) -> None:
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
        if self.max_patches and h * w > self.max_patches:
            raise ValueError(f"grid has more than {self.max_patches} patches a frame")
        if t > self.max_temporal:
            raise ValueError(f"grid has more than {self.max_temporal} temporal patches")
        if tuple(pixels.shape) != (t * h * w, self.patch_dim):
            raise ValueError(f"pixel_values must have shape [t*h*w, {self.patch_dim}]")

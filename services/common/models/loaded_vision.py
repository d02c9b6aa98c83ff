"""The vision half of a checkpoint, loaded and ready to run (encoder and colocated PD)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.devices import resolve_device, resolve_dtype
from services.common.models.vision_io import Grid, PixelLayout, batch_key, encode_images

WARMUP_IMAGE_SIZE = 64
"""Side of the blank image used for the warm-up forward (any size: the processor resizes)."""


@dataclass(frozen=True)
class LoadedVision:
    """Vision tower + projector on its device, with what a warm-up and input checks need.

    ``encode`` is the one batched forward both the encoder's batcher and the
    colocated PD call: images (pixels + grid) in, one embedding per image out.
    """

    module: torch.nn.Module  # see vision_io: fixed-size ([N, 3, H, W]) or packed patches with grids
    device: torch.device
    dtype: torch.dtype
    sample_pixels: torch.Tensor  # a blank image processed as the proxy would (warm-up input)
    num_tokens: int  # embedding rows the LM expects for sample_pixels
    hidden_size: int  # LM hidden size == embedding row width
    sample_grid: Grid | None = None  # sample_pixels' patch grid (dynamic-resolution towers)
    layout: PixelLayout = PixelLayout()  # what pixel tensors the module takes

    @classmethod
    def load(cls, model: str, device: str, dtype: str) -> LoadedVision:
        """Loads only the vision tower + projector of ``model`` (blocking; run off the event loop).

        ``model`` "" or a preset name means the built-in checkpoint, built on first use.
        """
        from PIL import Image

        from services.common.models import ensure_model, load_adapter

        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        adapter = load_adapter(str(ensure_model(model)))
        blank = Image.new("RGB", (WARMUP_IMAGE_SIZE, WARMUP_IMAGE_SIZE))
        sample = adapter.process_image(adapter.load_processor().image_processor, blank)
        return cls(
            module=adapter.load_vision(torch_device, torch_dtype).eval(),
            device=torch_device,
            dtype=torch_dtype,
            sample_pixels=sample.pixel_values,
            num_tokens=sample.num_tokens,
            hidden_size=adapter.hidden_size,
            sample_grid=sample.patch_grid,
            layout=adapter.pixel_layout(),
        )

    def encode(self, images: Sequence[tuple[torch.Tensor, Grid | None]]) -> list[torch.Tensor]:
        """One forward over (pixels, grid) pairs that share a ``batch_key``: ``[num_tokens, hidden]`` each."""
        return encode_images(self.module, images, self.device, self.dtype)

    def batch_key(self, pixels: torch.Tensor, grid: Grid | None) -> tuple:
        """Images with equal keys may share one ``encode`` call."""
        return batch_key(self.module, pixels, grid)

    def warm_up(self) -> None:
        """One forward of the blank image; RuntimeError unless it has the LM's embedding shape."""
        out = self.encode([(self.sample_pixels, self.sample_grid)])[0]
        want = (self.num_tokens, self.hidden_size)
        if tuple(out.shape) != want:
            raise RuntimeError(f"vision module produced shape {list(out.shape)} for a blank image, expected {list(want)}")

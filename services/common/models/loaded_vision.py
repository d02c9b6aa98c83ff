"""The vision half of a checkpoint, loaded and ready to run (encoder and colocated PD)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.devices import exact_float32, resolve_device, resolve_dtype

WARMUP_IMAGE_SIZE = 64
"""Side of the blank image used for the warm-up forward (any size: the processor resizes)."""


@dataclass(frozen=True)
class LoadedVision:
    """Vision tower + projector on its device, with what a warm-up needs."""

    module: torch.nn.Module  # VisionEncoder: [N, 3, H, W] -> [N, num_tokens, hidden_size]
    device: torch.device
    dtype: torch.dtype
    sample_pixels: torch.Tensor  # [3, H, W]: a blank image processed as the proxy would (warm-up input)
    num_tokens: int  # embedding rows the LM expects for sample_pixels
    hidden_size: int  # LM hidden size == embedding row width

    @classmethod
    def load(cls, model: str, device: str, dtype: str) -> LoadedVision:
        """Loads only the vision tower + projector of ``model`` (blocking; run off the event loop).

        ``model`` "" or a preset name means the built-in checkpoint, built on first use.
        """
        from PIL import Image

        from services.common.models import ensure_model, load_adapter

        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        exact_float32(torch_device, torch_dtype)
        adapter = load_adapter(str(ensure_model(model)))
        blank = Image.new("RGB", (WARMUP_IMAGE_SIZE, WARMUP_IMAGE_SIZE))
        pixels = adapter.load_processor().image_processor(images=[blank], return_tensors="pt")["pixel_values"][0]
        return cls(
            module=adapter.load_vision(torch_device, torch_dtype).eval(),
            device=torch_device,
            dtype=torch_dtype,
            sample_pixels=pixels,
            num_tokens=adapter.num_image_tokens(WARMUP_IMAGE_SIZE, WARMUP_IMAGE_SIZE),
            hidden_size=adapter.hidden_size,
        )

    def warm_up(self, max_batch_images: int = 1) -> None:
        """Forwards of the blank image; RuntimeError unless they have the LM's embedding shape.

        On CUDA a full batch of ``max_batch_images`` runs too, so the first
        real batch meets no cold kernel or allocator path.
        """
        batch_sizes = {1, max_batch_images} if self.device.type == "cuda" else {1}
        for batch_size in sorted(batch_sizes):
            pixels = self.sample_pixels.expand(batch_size, *self.sample_pixels.shape)
            with torch.inference_mode():
                out = self.module(pixels.to(device=self.device, dtype=self.dtype))
            want = (batch_size, self.num_tokens, self.hidden_size)
            if tuple(out.shape) != want:
                raise RuntimeError(f"vision module produced shape {list(out.shape)} for blank images, "
                                   f"expected {list(want)}")


def embeddings_to_host(out: torch.Tensor) -> list[torch.Tensor]:
    """A batch's ``[N, num_tokens, hidden]`` embeddings as N contiguous CPU tensors, one per image.

    On CUDA the batch is read back once, into page-locked memory (one
    asynchronous copy and one wait, instead of a synchronous copy per image),
    and each image then gets its own copy in ordinary memory: a cached
    embedding must neither pin the whole batch nor hold page-locked memory.
    """
    if out.device.type == "cuda":
        staged = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        staged.copy_(out, non_blocking=True)
        torch.cuda.current_stream(out.device).synchronize()
        out = staged
    return [row.to("cpu", copy=True).contiguous() for row in out.unbind(0)]

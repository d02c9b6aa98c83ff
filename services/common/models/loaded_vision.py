"""The vision half of a checkpoint, loaded and ready to run (encoder and colocated PD)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.cpu_linear import use_linear_backend
from services.common.devices import exact_float32, resolve_device, resolve_dtype
from services.common.encode_items import VIDEO_LIMITS, ProcessFile, file_processor
from services.common.models.pixel_layout import Grid, PixelLayout
from services.common.models.vision_io import batch_key, embedding_shape, encode_images
from services.common.video_files import VideoLimits

log = logging.getLogger(__name__)

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
    process_file: ProcessFile | None = None  # image files (EncodeItem.image_file) -> pixels
    num_deepstack_levels: int = 0  # DeepStack feature rows per token after its embedding row (Qwen3-VL)

    @classmethod
    def load(
        cls,
        model: str,
        device: str,
        dtype: str,
        video_limits: VideoLimits = VIDEO_LIMITS,
        linear_backend: str = "auto",
    ) -> LoadedVision:
        """Loads only the vision tower + projector of ``model`` (blocking; run off the event loop).

        ``model`` "" or a preset name means the built-in checkpoint, built on first use; ``video_limits``
        bound the videos ``process_file`` decodes; ``linear_backend`` picks who runs the linear layers
        (``services/common/cpu_linear.py``: on CPU in float32 the packed kernel by default, which ran a
        224x224 image through the bench checkpoint's tower 1.2x as fast as torch's matmul, 8 at once
        1.07x).
        """
        from PIL import Image

        from services.common.models.builder import ensure_model
        from services.common.models.families import load_adapter

        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        exact_float32(torch_device, torch_dtype)
        adapter = load_adapter(str(ensure_model(model)))
        image_processor = adapter.load_processor().image_processor
        blank = Image.new("RGB", (WARMUP_IMAGE_SIZE, WARMUP_IMAGE_SIZE))
        sample = adapter.process_image(image_processor, blank)
        module = adapter.load_vision(torch_device, torch_dtype).eval()
        backend = use_linear_backend(module, linear_backend, torch_device, torch_dtype)
        log.info("vision linear layers: %s", backend)
        return cls(
            module=module,
            device=torch_device,
            dtype=torch_dtype,
            sample_pixels=torch.from_numpy(sample.pixel_values),
            num_tokens=sample.num_tokens,
            hidden_size=adapter.hidden_size,
            sample_grid=sample.patch_grid,
            layout=adapter.pixel_layout(),
            process_file=file_processor(adapter, image_processor, video_limits),
            num_deepstack_levels=adapter.num_deepstack_levels,
        )

    def encode(self, images: Sequence[tuple[torch.Tensor, Grid | None]]) -> list[torch.Tensor]:
        """One forward over (pixels, grid) pairs that share a ``batch_key``: one embedding each
        (``embedding_shape``: ``[num_tokens, hidden]``, or with DeepStack levels ``[num_tokens, 1 + levels, hidden]``)."""
        return encode_images(self.module, images, self.device, self.dtype)

    def batch_key(self, pixels: torch.Tensor, grid: Grid | None) -> tuple:
        """Images with equal keys may share one ``encode`` call."""
        return batch_key(self.module, pixels, grid)

    def warm_up(self, max_batch_images: int = 1) -> None:
        """Forwards of the blank image; RuntimeError unless they have the LM's embedding shape.

        On CUDA a full batch of ``max_batch_images`` runs too, so the first
        real batch meets no cold kernel or allocator path.
        """
        batch_sizes = {1, max_batch_images} if self.device.type == "cuda" else {1}
        want = embedding_shape(self.num_tokens, self.hidden_size, self.num_deepstack_levels)
        for batch_size in sorted(batch_sizes):
            for out in self.encode([(self.sample_pixels, self.sample_grid)] * batch_size):
                if tuple(out.shape) != want:
                    raise RuntimeError(
                        f"vision module produced shape {list(out.shape)} for a blank image, expected {list(want)}"
                    )


def embeddings_to_host(rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One batch's per-image embeddings (``embedding_shape``) as contiguous CPU tensors, one per image.

    On CUDA the batch is read back once, into page-locked memory (one
    asynchronous copy and one wait, instead of a synchronous copy per image),
    and each image then gets its own copy in ordinary memory: a cached
    embedding must neither pin the whole batch nor hold page-locked memory.
    """
    if rows and rows[0].device.type == "cuda":
        flat = torch.cat([row.reshape(-1) for row in rows])
        staged = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        staged.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(flat.device).synchronize()
        sizes = [row.numel() for row in rows]
        return [part.view(row.shape).clone() for part, row in zip(staged.split(sizes), rows)]
    return [row.to("cpu", copy=True).contiguous() for row in rows]

"""The processing half of a model adapter: what the proxy needs of a checkpoint, without torch.

Configs, tokenizer, chat template, image processor, placeholder counts and
pixels as numpy float32 arrays. ``adapter.ModelAdapter`` adds the torch half
(loading the vision and language models); the proxy codes against
``ModelProcessing`` only, so it never imports torch itself.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .pixel_layout import Grid, PixelLayout

# Image-processor attributes that change the pixels a picture becomes (for mm_hash).
PIXEL_SETTINGS = (
    "do_convert_rgb",
    "do_resize",
    "size",
    "resample",
    "default_to_square",
    "do_center_crop",
    "crop_size",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_pad",
    "pad_size",
)


class UnsupportedModelError(ValueError):
    """A checkpoint of a model family this project does not serve; the message names the supported ones."""


class UnsupportedImageError(ValueError):
    """An image the model's processor cannot take (e.g. an extreme aspect ratio)."""


class TooFewFramesError(UnsupportedImageError):
    """A video with fewer sampled frames than the model's processor takes (Qwen3-VL: one temporal patch)."""


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the encoder takes it, and what the LM sees of it.

    ``pixel_values``: ``[3, H, W]`` for fixed-size towers (LLaVA); for
    dynamic-resolution towers (Qwen2-VL) the flattened patches ``[t*h*w,
    C*T*P*P]``, with ``patch_grid`` = the processor's ``(t, h, w)`` in patches
    and ``token_grid`` = the same in LM tokens (``t * h * w == num_tokens``).
    Services that run the tower take them with ``torch.from_numpy``.
    """

    pixel_values: np.ndarray  # float32, C-contiguous
    num_tokens: int  # placeholder tokens == embedding rows
    patch_grid: Grid | None = None
    token_grid: Grid | None = None


@dataclass(frozen=True)
class ImageShape:
    """What an image of some size becomes for the LM, known without its pixels (``ProcessedImage`` less pixels)."""

    num_tokens: int
    patch_grid: Grid | None = None
    token_grid: Grid | None = None


class ModelProcessing(ABC):
    """The torch-free half of one checkpoint of one model family: everything but weights.

    Attributes: ``family`` (config ``model_type``), ``model_id`` (directory
    name or hub id), ``image_token`` and ``image_token_id`` (the placeholder a
    processor expands per image), ``eos_token_ids`` (every id ``generate()``
    stops on: stopping and min_tokens masking need all of them),
    ``eos_token_id`` (the first of them), ``hidden_size`` (LM embedding width),
    ``max_model_len`` (LM positions), ``uses_mrope`` (the LM takes 3-D
    multimodal rotary positions; items then carry grids), ``supports_video``
    (Qwen2-VL family: ``video_token_id``, ``video_shape``, ``process_video``),
    ``tokens_per_second`` (Qwen2.5-VL's temporal position rate; None = one per
    temporal patch), ``num_deepstack_levels`` (Qwen3-VL: DeepStack feature rows
    an embedding carries per token besides its own), ``video_sampling_rule``
    (how frames are picked: ``video_files.Sampling.rule``).
    """

    family: str
    model_id: str
    image_token_id: int
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_size: int
    max_model_len: int
    uses_mrope: bool = False
    supports_video: bool = False
    video_token_id: int | None = None
    tokens_per_second: float | None = None
    num_deepstack_levels: int = 0
    video_sampling_rule: str = "qwen2_vl"

    @property
    @abstractmethod
    def image_token(self) -> str:
        """The placeholder text a processor expands once per image."""

    @abstractmethod
    def num_image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens (= embedding rows) for an image of this size."""

    @abstractmethod
    def process_image(self, image_processor: Any, image: Any) -> ProcessedImage:
        """One RGB PIL image through the checkpoint's image processor; ``UnsupportedImageError`` if it cannot."""

    def image_shape(self, height: int, width: int) -> ImageShape:
        """Tokens and grids of an image of this size, without its pixels (the proxy's count);
        ``UnsupportedImageError`` if the processor cannot take it. Grids: dynamic-resolution models only."""
        return ImageShape(self.num_image_tokens(height, width))

    def video_frame_texts(self, indices: Sequence[int], fps: float) -> tuple[tuple[str, str], ...]:
        """Text around each temporal patch's placeholder run of a video sampled at source frames
        ``indices`` of a ``fps`` source; empty (the default) when a video's placeholders are one run."""
        return ()

    @abstractmethod
    def pixel_layout(self) -> PixelLayout:
        """The pixel tensors the vision half takes (checked where they arrive)."""

    @abstractmethod
    def processor_settings(self) -> dict[str, Any]:
        """JSON-able image-processor settings that affect pixel values (part of ``mm_hash``)."""

    @abstractmethod
    def load_processor(self) -> Any:
        """A fresh processor: ``.tokenizer``, ``.image_processor``, ``.apply_chat_template``; no weights."""

    @abstractmethod
    def load_tokenizer(self) -> Any:
        """A fresh HF tokenizer; no weights."""


def float32_pixels(pixels: Any) -> np.ndarray:
    """An image processor's numpy output as a C-contiguous float32 array (no copy when it already is one)."""
    return np.ascontiguousarray(pixels, dtype=np.float32)


def pixel_settings(image_processor: Any, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The processor's class and pixel-affecting attributes, JSON-able (for ``mm_hash``)."""
    settings: dict[str, Any] = {"image_processor": type(image_processor).__name__}
    for key in PIXEL_SETTINGS + extra:
        if hasattr(image_processor, key):
            settings[key] = _jsonable(getattr(image_processor, key))
    return settings


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's content; ``{}`` when the file does not exist."""
    return json.loads(path.read_text()) if path.is_file() else {}


def eos_token_ids(directory: Path, fallback: int | list[int] | None) -> tuple[int, ...]:
    """The ids ``generate()`` stops on: generation_config.json's, else the LM config's."""
    eos = read_json(directory / "generation_config.json").get("eos_token_id", fallback)
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # SizeDict: keep the dimensions that are set
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items() if v is not None}
    if isinstance(value, enum.Enum):  # resampling filters
        return _jsonable(value.value)
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return str(value)

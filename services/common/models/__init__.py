"""Model checkpoints: the offline builder and the per-family split loaders.

Every service codes against ``load_adapter(path_or_hub_id)`` (see ``ModelAdapter``);
``build_checkpoint``/``ensure_model`` make the random-weight demo checkpoints.
Families: LLaVA (``llava.py``), Qwen2-VL and Qwen2.5-VL (``qwen_vl.py``).
"""

from .adapter import (
    ModelAdapter,
    ProcessedImage,
    UnsupportedImageError,
    UnsupportedModelError,
    count_parameters,
)
from .builder import build_checkpoint, default_model_dir, ensure_model
from .families import ADAPTERS, check_supported, load_adapter
from .llava import LlavaAdapter
from .loading import MissingWeightsError, Part, split_checkpoint_key, split_qwen_key
from .presets import PRESETS, Preset, get_preset
from .qwen_vl import QwenVLAdapter
from .vision import VisionEncoder
from .vision_io import PixelLayout, batch_key, encode_images

__all__ = [
    "ADAPTERS",
    "PRESETS",
    "LlavaAdapter",
    "MissingWeightsError",
    "ModelAdapter",
    "Part",
    "PixelLayout",
    "Preset",
    "ProcessedImage",
    "QwenVLAdapter",
    "UnsupportedImageError",
    "UnsupportedModelError",
    "VisionEncoder",
    "batch_key",
    "build_checkpoint",
    "check_supported",
    "count_parameters",
    "default_model_dir",
    "encode_images",
    "ensure_model",
    "get_preset",
    "load_adapter",
    "split_checkpoint_key",
    "split_qwen_key",
]

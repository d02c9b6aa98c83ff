"""Model checkpoints: the offline builder and the per-family split loaders.

Every service codes against ``load_adapter(path_or_hub_id)`` (see ``ModelAdapter``);
the proxy against its torch-free half, ``load_processing`` (see ``ModelProcessing``).
``build_checkpoint``/``ensure_model`` make the random-weight demo checkpoints.
Families: LLaVA (``llava.py``), Qwen2-VL and Qwen2.5-VL (``qwen_vl.py``), Qwen3-VL
and Qwen3-VL-MoE (``qwen3_vl.py``).

Importing this package imports neither torch nor transformers (which imports
torch whenever it is installed): names from modules that do are loaded on
first use, so importing a light submodule (``processing``, ``cache``,
``presets``) does not pull them in through here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .cache import default_model_dir
from .pixel_layout import PixelLayout
from .presets import PRESETS, Preset, get_preset
from .processing import ModelProcessing, ProcessedImage, UnsupportedImageError, UnsupportedModelError

if TYPE_CHECKING:
    from .adapter import ModelAdapter, count_parameters
    from .builder import build_checkpoint, ensure_model
    from .families import ADAPTERS, load_adapter
    from .llava import LlavaAdapter
    from .loading import MissingWeightsError, Part, split_checkpoint_key, split_qwen_key
    from .qwen3_vl import Qwen3VLAdapter
    from .qwen_vl import QwenVLAdapter
    from .supported import PROCESSING, check_supported, load_processing
    from .vision import VisionEncoder
    from .vision_io import batch_key, encode_images

# Names from modules that import transformers or torch -> that module, imported by ``__getattr__``.
_LAZY_NAMES = {
    "ADAPTERS": ".families",
    "batch_key": ".vision_io",
    "build_checkpoint": ".builder",
    "check_supported": ".supported",
    "count_parameters": ".adapter",
    "encode_images": ".vision_io",
    "ensure_model": ".builder",
    "LlavaAdapter": ".llava",
    "load_adapter": ".families",
    "load_processing": ".supported",
    "MissingWeightsError": ".loading",
    "ModelAdapter": ".adapter",
    "Part": ".loading",
    "PROCESSING": ".supported",
    "Qwen3VLAdapter": ".qwen3_vl",
    "QwenVLAdapter": ".qwen_vl",
    "split_checkpoint_key": ".loading",
    "split_qwen_key": ".loading",
    "VisionEncoder": ".vision",
}


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


__all__ = [
    "ADAPTERS",
    "PRESETS",
    "PROCESSING",
    "LlavaAdapter",
    "MissingWeightsError",
    "ModelAdapter",
    "ModelProcessing",
    "Part",
    "PixelLayout",
    "Preset",
    "ProcessedImage",
    "Qwen3VLAdapter",
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
    "load_processing",
    "split_checkpoint_key",
    "split_qwen_key",
]

"""The model families this project serves, without torch: ``check_supported`` (``served.py``) and ``load_processing``.

``families.load_adapter`` is the same lookup for services that also load weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .configs import load_config
from .llava_processing import LlavaProcessing
from .processing import ModelProcessing
from .qwen3_vl_processing import Qwen3VLProcessing
from .qwen_vl_processing import QwenVLProcessing
from .served import check_supported
from .source import CheckpointSource

# The torch-free half of each family, by config ``model_type`` (``served.MODEL_TYPES``); read-only.
PROCESSING: MappingProxyType[str, Callable[[CheckpointSource, Any], ModelProcessing]] = MappingProxyType(
    {
        "llava": LlavaProcessing,
        "qwen2_vl": QwenVLProcessing,
        "qwen2_5_vl": QwenVLProcessing,
        "qwen3_vl": Qwen3VLProcessing,
        "qwen3_vl_moe": Qwen3VLProcessing,
    }
)


def load_processing(path_or_hub_id: str | Path) -> ModelProcessing:
    """The torch-free half of a checkpoint's adapter (what the proxy uses); reads configs only, no weights."""
    source = CheckpointSource(path_or_hub_id)
    model_type = check_supported(source)
    return PROCESSING[model_type](source, load_config(source))

"""The model families this project serves, without torch: ``check_supported`` and ``load_processing``.

``families.load_adapter`` is the same lookup for services that also load weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .configs import load_config
from .llava_processing import LlavaProcessing
from .processing import ModelProcessing, UnsupportedModelError, read_json
from .qwen_vl_processing import QwenVLProcessing
from .source import CONFIG_PATTERNS, CheckpointSource

# The torch-free half of each family, by config ``model_type``; read-only.
PROCESSING: MappingProxyType[str, Callable[[CheckpointSource, Any], ModelProcessing]] = MappingProxyType(
    {"llava": LlavaProcessing, "qwen2_vl": QwenVLProcessing, "qwen2_5_vl": QwenVLProcessing}
)


def check_supported(source: CheckpointSource) -> str:
    """The checkpoint's ``model_type``; ``UnsupportedModelError`` (one line naming the supported ones) if not served.

    Reads ``config.json`` as plain JSON, so a model type unknown even to
    ``transformers`` gets the same clear message.
    """
    model_type = read_json(source.directory(CONFIG_PATTERNS) / "config.json").get("model_type")
    if not isinstance(model_type, str) or model_type not in PROCESSING:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} in {source.name}; supported model families: "
            f"{', '.join(sorted(PROCESSING))}"
        )
    return model_type


def load_processing(path_or_hub_id: str | Path) -> ModelProcessing:
    """The torch-free half of a checkpoint's adapter (what the proxy uses); reads configs only, no weights."""
    source = CheckpointSource(path_or_hub_id)
    model_type = check_supported(source)
    return PROCESSING[model_type](source, load_config(source))

"""The model families this project serves, and ``load_adapter``: a checkpoint -> its family's adapter.

Which families exist, and how a checkpoint is checked against them, is
``supported`` (torch-free, shared with the proxy); this module adds the weights' side.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .adapter import ModelAdapter
from .configs import load_config
from .llava import LlavaAdapter
from .qwen3_vl import Qwen3VLAdapter
from .qwen_vl import QwenVLAdapter
from .source import CheckpointSource
from .supported import check_supported

# Families by config ``model_type``, the same keys as ``supported.PROCESSING``; read-only.
ADAPTERS: MappingProxyType[str, Callable[[CheckpointSource, Any], ModelAdapter]] = MappingProxyType(
    {
        "llava": LlavaAdapter,
        "qwen2_vl": QwenVLAdapter,
        "qwen2_5_vl": QwenVLAdapter,
        "qwen3_vl": Qwen3VLAdapter,
        "qwen3_vl_moe": Qwen3VLAdapter,
    }
)
__all__ = ["ADAPTERS", "check_supported", "load_adapter"]


def load_adapter(path_or_hub_id: str | Path) -> ModelAdapter:
    """The adapter for a checkpoint directory or hub id; reads the configs only, no weights."""
    source = CheckpointSource(path_or_hub_id)
    model_type = check_supported(source)
    return ADAPTERS[model_type](source, load_config(source))

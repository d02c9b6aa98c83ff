"""The model families this project serves, and ``load_adapter``: a checkpoint -> its family's adapter."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from transformers import AutoConfig

from .adapter import ModelAdapter, UnsupportedModelError, read_json
from .llava import LlavaAdapter
from .qwen_vl import QwenVLAdapter
from .source import CONFIG_PATTERNS, CheckpointSource

# Families by config ``model_type``; read-only.
ADAPTERS: MappingProxyType[str, type[ModelAdapter]] = MappingProxyType(
    {"llava": LlavaAdapter, "qwen2_vl": QwenVLAdapter, "qwen2_5_vl": QwenVLAdapter}
)


def check_supported(source: CheckpointSource) -> str:
    """The checkpoint's ``model_type``; ``UnsupportedModelError`` (one line naming the supported ones) if not served.

    Reads ``config.json`` as plain JSON, so a model type unknown even to
    ``transformers`` gets the same clear message.
    """
    model_type = read_json(source.directory(CONFIG_PATTERNS) / "config.json").get("model_type")
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} in {source.name}; supported model families: "
            f"{', '.join(sorted(ADAPTERS))}"
        )
    return model_type


def load_adapter(path_or_hub_id: str | Path) -> ModelAdapter:
    """The adapter for a checkpoint directory or hub id; reads the configs only, no weights."""
    source = CheckpointSource(path_or_hub_id)
    model_type = check_supported(source)
    config = AutoConfig.from_pretrained(source.directory(CONFIG_PATTERNS))
    return ADAPTERS[model_type](source, config)

"""A checkpoint's transformers config, read without torch or weights."""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PreTrainedConfig

from .source import CONFIG_PATTERNS, CheckpointSource


def load_config(source: CheckpointSource) -> Any:
    """The checkpoint's transformers config (configs only, no weights)."""
    return AutoConfig.from_pretrained(source.directory(CONFIG_PATTERNS))


def text_config_of(config: Any) -> PreTrainedConfig:
    """A VLM config's LM config (the VLM config turns a dict into one when it is made or loaded)."""
    text_config = config.text_config
    if not isinstance(text_config, PreTrainedConfig):
        raise TypeError("the model config has no text_config")
    return text_config

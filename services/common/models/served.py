"""Which model families are served, decided from a checkpoint's ``config.json`` alone.

Imports neither transformers nor torch, so that ``epd up`` can refuse an
unservable ``--model`` before any child starts without loading either
(``startup.refuse_unservable_model``). ``supported.PROCESSING`` and
``families.ADAPTERS`` hold one entry per name here.
"""

from __future__ import annotations

from .processing import UnsupportedModelError, read_json
from .source import CONFIG_PATTERNS, CheckpointSource

MODEL_TYPES = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
"""The config ``model_type`` of every family served."""


def check_supported(source: CheckpointSource) -> str:
    """The checkpoint's ``model_type``; ``UnsupportedModelError`` (one line naming the supported ones) if not served.

    Reads ``config.json`` as plain JSON, so a model type unknown even to
    ``transformers`` gets the same clear message.
    """
    model_type = read_json(source.directory(CONFIG_PATTERNS) / "config.json").get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} in {source.name}; supported model families: "
            f"{', '.join(sorted(MODEL_TYPES))}"
        )
    return model_type

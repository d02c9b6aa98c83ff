"""Model adapters: how one family's checkpoint splits into an encoder half and an LM half.

``load_adapter`` reads ``config.json`` only and picks the family by
``model_type``; weights are read when a service asks for its half.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import json
from abc import ABC, abstractmethod
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoProcessor,
    AutoTokenizer,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
)

from .loading import Part, SafetensorsCheckpoint, load_part
from .source import CONFIG_PATTERNS, PROCESSOR_PATTERNS, WEIGHT_PATTERNS, CheckpointSource
from .vision import VisionEncoder

# Image-processor attributes that change the pixels a picture becomes (for mm_hash).
_PIXEL_SETTINGS = (
    "do_convert_rgb", "do_resize", "size", "resample", "default_to_square", "do_center_crop", "crop_size",
    "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std", "do_pad", "pad_size",
)


class ModelAdapter(ABC):
    """One checkpoint of one model family, split for disaggregated serving.

    Attributes: ``model_id`` (directory name or hub id), ``image_token`` and
    ``image_token_id`` (the placeholder a processor expands per image),
    ``eos_token_id`` (first of ``eos_token_ids``, the ids ``generate()`` stops on),
    ``hidden_size`` (LM embedding width), ``max_model_len`` (LM positions).
    """

    model_id: str
    image_token: str
    image_token_id: int
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_size: int
    max_model_len: int

    @abstractmethod
    def num_image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens (= embedding rows) for an image of this size."""

    @abstractmethod
    def processor_settings(self) -> dict[str, Any]:
        """JSON-able image-processor settings that affect pixel values (part of ``mm_hash``)."""

    @abstractmethod
    def load_processor(self) -> Any:
        """A fresh HF processor (tokenizer, image processor, chat template); no weights."""

    @abstractmethod
    def load_tokenizer(self) -> Any:
        """A fresh HF tokenizer; no weights."""

    @abstractmethod
    def load_vision(self, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
        """The vision tower and projector only, in eval mode."""

    @abstractmethod
    def load_language_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        """A ``*ForCausalLM`` holding only the LM weights, in eval mode."""

    @abstractmethod
    def load_full_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        """The whole HF model, for reference outputs in tests."""


class LlavaAdapter(ModelAdapter):
    """LLaVA-style models: CLIP/SigLIP vision tower + MLP projector + a causal LM."""

    def __init__(self, source: CheckpointSource, config: LlavaConfig):
        self.source = source
        self.config = config
        text_config = config.text_config
        self.model_id = source.model_id
        self.image_token_id = config.image_token_id
        self.hidden_size = text_config.hidden_size
        self.max_model_len = text_config.max_position_embeddings
        config_dir = source.directory(CONFIG_PATTERNS)
        self.image_token = _read_json(config_dir / "processor_config.json").get("image_token", "<image>")
        self.eos_token_ids = _eos_token_ids(config_dir, text_config.eos_token_id)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    @functools.cached_property
    def _processor(self) -> Any:
        """Private shared instance for read-only questions (token counts, settings)."""
        return self.load_processor()

    def num_image_tokens(self, height: int, width: int) -> int:
        counts = self._processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
        return int(counts.num_image_tokens[0])

    def processor_settings(self) -> dict[str, Any]:
        image_processor = self._processor.image_processor
        settings: dict[str, Any] = {"image_processor": type(image_processor).__name__}
        for key in _PIXEL_SETTINGS:
            if hasattr(image_processor, key):
                settings[key] = _jsonable(getattr(image_processor, key))
        return settings

    def load_processor(self) -> Any:
        return AutoProcessor.from_pretrained(self.source.directory(PROCESSOR_PATTERNS))

    def load_tokenizer(self) -> Any:
        return AutoTokenizer.from_pretrained(self.source.directory(PROCESSOR_PATTERNS))

    def _weights(self) -> SafetensorsCheckpoint:
        return SafetensorsCheckpoint(self.source.directory(WEIGHT_PATTERNS))

    def load_vision(self, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
        with init_empty_weights():
            encoder = VisionEncoder(self.config)
        parts = {"vision_tower": Part.VISION_TOWER, "multi_modal_projector": Part.PROJECTOR}
        load_part(encoder, self._weights(), parts, torch.device(device), dtype)
        return encoder.eval().requires_grad_(False)

    def load_language_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        with init_empty_weights():  # a copy: from_config records attention/dtype choices on its config
            model = AutoModelForCausalLM.from_config(copy.deepcopy(self.config.text_config), dtype=dtype)
        tied = self.config.tie_word_embeddings or self.config.text_config.tie_word_embeddings
        load_part(
            model, self._weights(), {"": Part.LANGUAGE_MODEL}, torch.device(device), dtype,
            derive=functools.partial(_tied_head, tied=tied),
        )
        return model.eval().requires_grad_(False)

    def load_full_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        directory = self.source.directory(WEIGHT_PATTERNS + PROCESSOR_PATTERNS)
        model = LlavaForConditionalGeneration.from_pretrained(directory, dtype=dtype)
        return model.to(device).eval()


def _tied_head(missing: set[str], tied: bool) -> dict[str, str]:
    """With tied embeddings a checkpoint may omit the head: it shares the input embeddings."""
    return {"lm_head.weight": "model.embed_tokens.weight"} if tied and "lm_head.weight" in missing else {}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _eos_token_ids(directory: Path, fallback: int | list[int] | None) -> tuple[int, ...]:
    """The ids ``generate()`` stops on: generation_config.json's, else the LM config's."""
    eos = _read_json(directory / "generation_config.json").get("eos_token_id", fallback)
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value):  # SizeDict: keep only the dimensions that are set
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items() if v is not None}
    if isinstance(value, enum.Enum):  # resampling filters
        return _jsonable(value.value)
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return str(value)


# Families by config ``model_type``; read-only.
_ADAPTERS: MappingProxyType[str, type[LlavaAdapter]] = MappingProxyType({"llava": LlavaAdapter})


def load_adapter(path_or_hub_id: str | Path) -> ModelAdapter:
    """The adapter for a checkpoint directory or hub id; reads ``config.json`` only."""
    source = CheckpointSource(path_or_hub_id)
    config = AutoConfig.from_pretrained(source.directory(CONFIG_PATTERNS))
    family = _ADAPTERS.get(config.model_type)
    if family is None:
        raise ValueError(f"unsupported model_type {config.model_type!r}; supported: {sorted(_ADAPTERS)}")
    return family(source, config)


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters (tied tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())

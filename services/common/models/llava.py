"""LLaVA-style checkpoints: CLIP/SigLIP vision tower + MLP projector + a Llama-family causal LM.

The torch-free half (configs, processor, pixels) is ``llava_processing.LlavaProcessing``.
"""

from __future__ import annotations

import copy
import functools

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration, PreTrainedModel

from .adapter import ModelAdapter, tied_head
from .llava_processing import LlavaProcessing
from .loading import Part, SafetensorsCheckpoint, load_part
from .source import PROCESSOR_PATTERNS, WEIGHT_PATTERNS
from .vision import VisionEncoder


class LlavaAdapter(LlavaProcessing, ModelAdapter):
    """LLaVA-style models: ``LlavaProcessing`` plus the split weights."""

    def _weights(self) -> SafetensorsCheckpoint:
        return SafetensorsCheckpoint(self.source.directory(WEIGHT_PATTERNS))

    def load_vision(self, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
        with init_empty_weights():
            encoder = VisionEncoder(self.config)
        parts = {"vision_tower": Part.VISION_TOWER, "multi_modal_projector": Part.PROJECTOR}
        load_part(encoder, self._weights(), parts, torch.device(device), dtype)
        encoder.drop_unused_layers()
        return encoder.eval().requires_grad_(False)

    def load_language_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        text_config = self.text_config
        with init_empty_weights():  # a copy: from_config records attention/dtype choices on its config
            model = AutoModelForCausalLM.from_config(copy.deepcopy(text_config), dtype=dtype)
        tied = self.config.tie_word_embeddings or text_config.tie_word_embeddings
        load_part(
            model,
            self._weights(),
            {"": Part.LANGUAGE_MODEL},
            torch.device(device),
            dtype,
            derive=functools.partial(tied_head, tied=tied),
        )
        return model.eval().requires_grad_(False)

    def load_full_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        directory = self.source.directory(WEIGHT_PATTERNS + PROCESSOR_PATTERNS)
        model = LlavaForConditionalGeneration.from_pretrained(directory, dtype=dtype)
        return model.to(device).eval()  # type: ignore[arg-type]  # transformers types its to() wrapper without self

"""Qwen2-VL and Qwen2.5-VL checkpoints: dynamic resolution and multimodal RoPE.

The vision half (tower with window attention on 2.5, patch merger) takes the
flattened patches of any number of images of any grids in one packed forward.
The LM half is the text decoder + head; it rotates by 3-D positions
(``services/pd/engine/positions.py``). The torch-free half (configs,
processor, grids, pixels) is ``qwen_vl_processing.QwenVLProcessing``.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForImageTextToText, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLPreTrainedModel,
    Qwen2_5_VLTextModel,
)
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VisionTransformerPretrainedModel,
    Qwen2VLPreTrainedModel,
    Qwen2VLTextModel,
)
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel  # the Qwen3-VL LMs share _TextCausalLM
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextModel

from .adapter import ModelAdapter, tied_head
from .loading import Part, SafetensorsCheckpoint, TensorFit, load_part, split_qwen_key
from .qwen_vl_processing import QwenVLProcessing
from .source import PROCESSOR_PATTERNS, WEIGHT_PATTERNS


class _TextCausalLM:
    """The text decoder (``model``) + ``lm_head`` of a Qwen VLM, without its vision tower.

    ``position_ids`` may be ``[3, batch, tokens]`` (temporal, height, width
    rotary positions) or ``[batch, tokens]`` (the same id on every axis).
    """

    uses_mrope = True
    # The family's text decoder, named by each concrete class; __init__ builds it as ``model``.
    text_model_class: type[Qwen2VLTextModel | Qwen2_5_VLTextModel | Qwen3VLTextModel | Qwen3VLMoeTextModel]
    model: Qwen2VLTextModel | Qwen2_5_VLTextModel | Qwen3VLTextModel | Qwen3VLMoeTextModel
    lm_head: nn.Linear

    def __init__(self, config):
        super().__init__(config)  # type: ignore[call-arg]  # the concrete classes' PreTrainedModel base takes it
        self.model = self.text_model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()  # type: ignore[attr-defined]

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None, **kwargs: Any
    ) -> CausalLMOutputWithPast:
        hidden = self.model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **kwargs,
        ).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden))


class Qwen2VLTextForCausalLM(_TextCausalLM, Qwen2VLPreTrainedModel):
    """Qwen2-VL's language model alone (see ``_TextCausalLM``)."""

    text_model_class = Qwen2VLTextModel


class Qwen2_5_VLTextForCausalLM(_TextCausalLM, Qwen2_5_VLPreTrainedModel):
    """Qwen2.5-VL's language model alone (see ``_TextCausalLM``)."""

    text_model_class = Qwen2_5_VLTextModel


class QwenVisionEncoder(nn.Module):
    """Patches of several images (any grids) -> their LM-space embeddings, in one packed forward.

    Holds exactly the checkpoint's ``visual`` module (tower + merger); computes
    what ``get_image_features`` computes, rows in the LM's token order.
    """

    packs_grids = True

    def __init__(self, tower_class: type[PreTrainedModel], vision_config):
        super().__init__()
        self.visual = tower_class._from_config(vision_config)
        self.spatial_merge_size: int = vision_config.spatial_merge_size

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` [sum t*h*w, C*T*P*P], ``grid_thw`` [N, 3] -> [sum t*h*w / merge**2, hidden]."""
        return self.visual(pixel_values, grid_thw=grid_thw).pooler_output


@dataclass(frozen=True)
class _Family:
    lm: type[PreTrainedModel]
    tower: type[PreTrainedModel]
    encoder: type[QwenVisionEncoder] = QwenVisionEncoder
    fit: TensorFit | None = None  # a stored LM tensor's layout into the module's, where a family stores another


_FAMILIES = {
    "qwen2_vl": _Family(Qwen2VLTextForCausalLM, Qwen2VisionTransformerPretrainedModel),
    "qwen2_5_vl": _Family(Qwen2_5_VLTextForCausalLM, Qwen2_5_VisionTransformerPretrainedModel),
}


class QwenVLAdapter(QwenVLProcessing, ModelAdapter):
    """Qwen2-VL / Qwen2.5-VL: ``QwenVLProcessing`` plus the split weights."""

    _families: dict[str, _Family] = _FAMILIES

    @property
    def _parts(self) -> _Family:
        return self._families[self.family]

    def _weights(self) -> SafetensorsCheckpoint:
        return SafetensorsCheckpoint(self.source.directory(WEIGHT_PATTERNS))

    def load_vision(self, device: torch.device, dtype: torch.dtype) -> QwenVisionEncoder:
        with init_empty_weights():
            encoder = self._parts.encoder(self._parts.tower, copy.deepcopy(self.config.vision_config))
        load_part(
            encoder,
            self._weights(),
            {"visual": Part.VISION_TOWER},
            torch.device(device),
            dtype,
            splitter=split_qwen_key,
        )
        return encoder.eval().requires_grad_(False)

    def load_language_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        text_config = copy.deepcopy(self.config.text_config)
        with init_empty_weights():
            model = self._parts.lm._from_config(text_config, dtype=dtype)
        tied = self.config.tie_word_embeddings or getattr(text_config, "tie_word_embeddings", False)
        load_part(
            model,
            self._weights(),
            {"": Part.LANGUAGE_MODEL},
            torch.device(device),
            dtype,
            derive=functools.partial(tied_head, tied=tied),
            splitter=split_qwen_key,
            fit=self._parts.fit,
        )
        return model.eval().requires_grad_(False)

    def load_full_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        directory = self.source.directory(WEIGHT_PATTERNS + PROCESSOR_PATTERNS)
        model = AutoModelForImageTextToText.from_pretrained(directory, dtype=dtype)
        return model.to(device).eval()  # type: ignore[arg-type]  # transformers types its to() wrapper without self

"""Qwen3-VL and Qwen3-VL-MoE checkpoints: DeepStack features and interleaved multimodal RoPE.

The vision half (``Qwen3VisionEncoder``: tower, merger and the DeepStack
mergers) returns, per LM token, the merged embedding and one feature row per
DeepStack level: ``[tokens, 1 + levels, hidden]``. The LM half is the text
decoder + head; transformers' text model adds level ``i`` to the hidden states
of the visual positions after its layer ``i`` (``visual_pos_masks``,
``deepstack_visual_embeds``), which PD's runner passes per step
(``services/pd/runner/deepstack.py``). The torch-free half is
``qwen3_vl_processing.Qwen3VLProcessing``.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLPreTrainedModel,
    Qwen3VLTextModel,
    Qwen3VLVisionModel,
)
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
    Qwen3VLMoePreTrainedModel,
    Qwen3VLMoeTextModel,
    Qwen3VLMoeVisionModel,
)

from .adapter import ModelAdapter, tied_head
from .loading import QWEN3_MOE_EXPERT_TENSORS, Part, SafetensorsCheckpoint, load_part, split_qwen_key
from .qwen3_vl_processing import Qwen3VLProcessing
from .qwen_vl import QwenVLAdapter, _TextCausalLM
from .source import WEIGHT_PATTERNS


class Qwen3VLTextForCausalLM(_TextCausalLM, Qwen3VLPreTrainedModel):
    """Qwen3-VL's language model alone (see ``_TextCausalLM``); takes DeepStack features as keywords."""

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen3VLTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Qwen3VLMoeTextForCausalLM(_TextCausalLM, Qwen3VLMoePreTrainedModel):
    """Qwen3-VL-MoE's language model alone (see ``_TextCausalLM``); takes DeepStack features as keywords."""

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen3VLMoeTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Qwen3VisionEncoder(nn.Module):
    """Patches of several images (any grids) -> per LM token its embedding and DeepStack rows, in one forward.

    Holds exactly the checkpoint's ``visual`` module (tower, merger, DeepStack
    mergers); computes what ``get_image_features`` computes, rows in the LM's
    token order.
    """

    packs_grids = True

    def __init__(self, tower_class: type[PreTrainedModel], vision_config):
        super().__init__()
        self.visual = tower_class._from_config(vision_config)
        self.spatial_merge_size: int = vision_config.spatial_merge_size
        self.num_deepstack_levels: int = len(vision_config.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` [sum t*h*w, C*T*P*P], ``grid_thw`` [N, 3] -> [sum t*h*w / merge**2, 1 + levels, hidden]."""
        out = self.visual(pixel_values, grid_thw=grid_thw)
        return torch.stack([out.pooler_output, *out.deepstack_features], dim=1)


@dataclass(frozen=True)
class _Family:
    lm: type[PreTrainedModel]
    tower: type[PreTrainedModel]


_FAMILIES = {
    "qwen3_vl": _Family(Qwen3VLTextForCausalLM, Qwen3VLVisionModel),
    "qwen3_vl_moe": _Family(Qwen3VLMoeTextForCausalLM, Qwen3VLMoeVisionModel),
}


def fit_expert_layout(name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A fused expert tensor in the published order (``builder_qwen3``) as the module holds it; any other
    tensor, and one already in the module's order, unchanged (transformers' ``Transpose(check_dims=True)``)."""
    if name.endswith(QWEN3_MOE_EXPERT_TENSORS) and tensor.shape != shape and tensor.transpose(1, 2).shape == shape:
        return tensor.transpose(1, 2).contiguous()
    return tensor


class Qwen3VLAdapter(Qwen3VLProcessing, QwenVLAdapter, ModelAdapter):
    """Qwen3-VL / Qwen3-VL-MoE: ``Qwen3VLProcessing`` plus the split weights (``load_full_model``: Qwen2.5-VL's)."""

    @property
    def _qwen3(self) -> _Family:
        return _FAMILIES[self.family]

    def load_vision(self, device: torch.device, dtype: torch.dtype) -> Qwen3VisionEncoder:  # type: ignore[override]
        with init_empty_weights():
            encoder = Qwen3VisionEncoder(self._qwen3.tower, copy.deepcopy(self.config.vision_config))
        load_part(
            encoder,
            SafetensorsCheckpoint(self.source.directory(WEIGHT_PATTERNS)),
            {"visual": Part.VISION_TOWER},
            torch.device(device),
            dtype,
            splitter=split_qwen_key,
        )
        return encoder.eval().requires_grad_(False)

    def load_language_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        text_config = copy.deepcopy(self.config.text_config)
        with init_empty_weights():
            model = self._qwen3.lm._from_config(text_config, dtype=dtype)
        tied = self.config.tie_word_embeddings or getattr(text_config, "tie_word_embeddings", False)
        load_part(
            model,
            SafetensorsCheckpoint(self.source.directory(WEIGHT_PATTERNS)),
            {"": Part.LANGUAGE_MODEL},
            torch.device(device),
            dtype,
            derive=functools.partial(tied_head, tied=tied),
            splitter=split_qwen_key,
            fit=fit_expert_layout,
        )
        model.num_deepstack_levels = self.num_deepstack_levels  # what the runner passes per step
        return model.eval().requires_grad_(False)

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

import torch
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

from .adapter import ModelAdapter
from .loading import QWEN3_MOE_EXPERT_TENSORS
from .qwen3_vl_processing import Qwen3VLProcessing
from .qwen_vl import QwenVisionEncoder, QwenVLAdapter, _Family, _TextCausalLM


class Qwen3VLTextForCausalLM(_TextCausalLM, Qwen3VLPreTrainedModel):
    """Qwen3-VL's language model alone (see ``_TextCausalLM``); takes DeepStack features as keywords."""

    text_model_class = Qwen3VLTextModel


class Qwen3VLMoeTextForCausalLM(_TextCausalLM, Qwen3VLMoePreTrainedModel):
    """Qwen3-VL-MoE's language model alone (see ``_TextCausalLM``); takes DeepStack features as keywords."""

    text_model_class = Qwen3VLMoeTextModel


class Qwen3VisionEncoder(QwenVisionEncoder):
    """Patches of several images (any grids) -> per LM token its embedding and DeepStack rows, in one forward.

    Holds exactly the checkpoint's ``visual`` module (tower, merger, DeepStack
    mergers); computes what ``get_image_features`` computes, rows in the LM's
    token order.
    """

    def __init__(self, tower_class: type[PreTrainedModel], vision_config):
        super().__init__(tower_class, vision_config)
        self.num_deepstack_levels: int = len(vision_config.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` [sum t*h*w, C*T*P*P], ``grid_thw`` [N, 3] -> [sum t*h*w / merge**2, 1 + levels, hidden]."""
        out = self.visual(pixel_values, grid_thw=grid_thw)
        return torch.stack([out.pooler_output, *out.deepstack_features], dim=1)


def fit_expert_layout(name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A fused expert tensor in the published order (``builder_qwen3``) as the module holds it; any other
    tensor, and one already in the module's order, unchanged (transformers' ``Transpose(check_dims=True)``)."""
    if name.endswith(QWEN3_MOE_EXPERT_TENSORS) and tensor.shape != shape and tensor.transpose(1, 2).shape == shape:
        return tensor.transpose(1, 2).contiguous()
    return tensor


_FAMILIES = {
    "qwen3_vl": _Family(Qwen3VLTextForCausalLM, Qwen3VLVisionModel, Qwen3VisionEncoder, fit_expert_layout),
    "qwen3_vl_moe": _Family(Qwen3VLMoeTextForCausalLM, Qwen3VLMoeVisionModel, Qwen3VisionEncoder, fit_expert_layout),
}


class Qwen3VLAdapter(Qwen3VLProcessing, QwenVLAdapter, ModelAdapter):
    """Qwen3-VL / Qwen3-VL-MoE: ``Qwen3VLProcessing`` plus the split weights, loaded as Qwen2.5-VL's are
    (this module's ``_FAMILIES``: DeepStack encoder, fused experts in the published order)."""

    _families = _FAMILIES

    def load_language_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        model = super().load_language_model(device, dtype)
        model.num_deepstack_levels = self.num_deepstack_levels  # type: ignore[assignment]  # what the runner passes per step
        return model

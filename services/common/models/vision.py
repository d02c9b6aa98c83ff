"""The encoder half of a LLaVA model: vision tower + multimodal projector."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModel, LlavaConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from .configs import text_config_of


class VisionEncoder(nn.Module):
    """Pixels to LM-space embeddings, one row per image placeholder token.

    Computes exactly what ``LlavaModel.get_image_features`` computes: the hidden
    states of ``vision_feature_layer`` (one layer, or several concatenated on the
    feature axis), minus the CLS token under the ``"default"`` strategy, through
    the projector. Module names match the checkpoint's, so a ``VisionEncoder``
    holds exactly the full model's ``vision_tower`` and ``multi_modal_projector``.
    """

    def __init__(self, config: LlavaConfig):
        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        layer = config.vision_feature_layer
        self.feature_layers: tuple[int, ...] = (layer,) if isinstance(layer, int) else tuple(layer)
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.hidden_size: int = text_config_of(config).hidden_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` [N, 3, H, W] -> embeddings [N, num_image_tokens, hidden_size]."""
        outputs = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        selected = [outputs.hidden_states[layer] for layer in self.feature_layers]
        if self.drop_cls:
            selected = [hidden[:, 1:] for hidden in selected]
        features = selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
        return self.multi_modal_projector(features)

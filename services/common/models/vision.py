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

    def drop_unused_layers(self) -> int:
        """Drops the tower's layers past the last one whose hidden states are used; returns how many.

        LLaVA-1.5 takes the penultimate layer's states (``vision_feature_layer``
        -2): the last layer, a twelfth of a ViT-B's work, was computed for
        nothing. ``hidden_states`` of the shortened tower are those of the full
        one up to its length, so the features are bit for bit the same.
        """
        encoder = getattr(self.vision_tower, "encoder", None)
        if encoder is None:  # a tower that nests its transformer one level down
            encoder = getattr(getattr(self.vision_tower, "vision_model", None), "encoder", None)
        layers = getattr(encoder, "layers", None)
        if encoder is None or not isinstance(layers, nn.ModuleList):
            return 0
        num_layers = len(layers)
        used = tuple(layer % (num_layers + 1) for layer in self.feature_layers)  # num_layers + 1 hidden states
        keep = max(used)
        if keep >= num_layers:
            return 0
        encoder.layers = layers[:keep]
        self.feature_layers = used
        return num_layers - keep

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` [N, 3, H, W] -> embeddings [N, num_image_tokens, hidden_size]."""
        outputs = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        selected = [outputs.hidden_states[layer] for layer in self.feature_layers]
        if self.drop_cls:
            selected = [hidden[:, 1:] for hidden in selected]
        features = selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
        return self.multi_modal_projector(features)

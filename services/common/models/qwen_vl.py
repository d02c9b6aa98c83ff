"""Qwen2-VL and Qwen2.5-VL checkpoints: dynamic resolution and multimodal RoPE.

An image keeps its aspect ratio: the processor resizes it to a multiple of
``patch_size * merge_size`` with a pixel count within ``min_pixels`` /
``max_pixels`` and cuts it into patches; its token count is ``t * h * w /
merge_size**2`` for its patch grid ``(t, h, w)``. The vision half (tower with
window attention on 2.5, patch merger) takes the flattened patches of any
number of images of any grids in one packed forward. The LM half is the text
decoder + head; it rotates by 3-D positions (``services/pd/engine/positions.py``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import (
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
)
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

from .adapter import ModelAdapter, ProcessedImage, UnsupportedImageError, eos_token_ids, pixel_settings, tied_head
from .loading import Part, SafetensorsCheckpoint, load_part, split_qwen_key
from .source import CONFIG_PATTERNS, PROCESSOR_PATTERNS, WEIGHT_PATTERNS, CheckpointSource
from .vision_io import PixelLayout

# The patch count a tower accepts, relative to what the processor's max_pixels
# allows: smart_resize may exceed max_pixels for very elongated images.
_MAX_PATCHES_SLACK = 4


class _TextCausalLM:
    """The text decoder (``model``) + ``lm_head`` of a Qwen VLM, without its vision tower.

    ``position_ids`` may be ``[3, batch, tokens]`` (temporal, height, width
    rotary positions) or ``[batch, tokens]`` (the same id on every axis).
    """

    uses_mrope = True

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

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen2VLTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Qwen2_5_VLTextForCausalLM(_TextCausalLM, Qwen2_5_VLPreTrainedModel):
    """Qwen2.5-VL's language model alone (see ``_TextCausalLM``)."""

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen2_5_VLTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


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
class QwenProcessor:
    """What the proxy needs of a Qwen checkpoint's processor: the tokenizer (it holds the chat
    template) and the image processor. transformers' processor class also needs a video
    processor, which cannot be built without torchvision; images need only these two."""

    tokenizer: Any
    image_processor: Any

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)


@dataclass(frozen=True)
class _Family:
    lm: type[PreTrainedModel]
    tower: type[PreTrainedModel]


_FAMILIES = {
    "qwen2_vl": _Family(Qwen2VLTextForCausalLM, Qwen2VisionTransformerPretrainedModel),
    "qwen2_5_vl": _Family(Qwen2_5_VLTextForCausalLM, Qwen2_5_VisionTransformerPretrainedModel),
}


class QwenVLAdapter(ModelAdapter):
    """Qwen2-VL / Qwen2.5-VL: dynamic resolution, 3-D rotary positions, grids on the wire."""

    uses_mrope = True

    def __init__(self, source: CheckpointSource, config: Any):
        self.source = source
        self.config = config
        self.family = config.model_type
        self._parts = _FAMILIES[self.family]
        text_config = config.text_config
        self.model_id = source.model_id
        self.image_token_id = config.image_token_id
        self.hidden_size = text_config.hidden_size
        self.max_model_len = text_config.max_position_embeddings
        self.eos_token_ids = eos_token_ids(source.directory(CONFIG_PATTERNS), text_config.eos_token_id)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    @functools.cached_property
    def _processor(self) -> QwenProcessor:
        """Private shared instance for read-only questions (token counts, settings)."""
        return self.load_processor()

    @property
    def image_token(self) -> str:
        return self._processor.tokenizer.convert_ids_to_tokens(self.image_token_id)

    @property
    def merge_size(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    def num_image_tokens(self, height: int, width: int) -> int:
        try:
            patches = self._processor.image_processor.get_number_of_image_patches(height, width)
        except ValueError:
            raise UnsupportedImageError(_SHAPE_REFUSED) from None
        return patches // (self.merge_size * self.merge_size)

    def process_image(self, image_processor: Any, image: Any) -> ProcessedImage:
        try:
            out = image_processor(images=[image], return_tensors="pt")
        except ValueError:  # smart_resize refuses aspect ratios above 200:1
            raise UnsupportedImageError(_SHAPE_REFUSED) from None
        t, h, w = (int(n) for n in out["image_grid_thw"][0])
        merge = self.merge_size
        return ProcessedImage(
            pixel_values=out["pixel_values"].to(torch.float32).contiguous(),  # [t*h*w, C*T*P*P]
            num_tokens=t * h * w // (merge * merge),
            patch_grid=(t, h, w),
            token_grid=(t, h // merge, w // merge),
        )

    def pixel_layout(self) -> PixelLayout:
        vision = self.config.vision_config
        image_processor = self._processor.image_processor
        max_pixels = image_processor.size["longest_edge"]
        return PixelLayout(
            patch_dim=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
            merge_size=self.merge_size,
            max_patches=_MAX_PATCHES_SLACK * max_pixels // image_processor.patch_size**2,
        )

    def processor_settings(self) -> dict[str, Any]:
        extra = ("patch_size", "temporal_patch_size", "merge_size")
        return pixel_settings(self._processor.image_processor, extra)

    def load_processor(self) -> QwenProcessor:
        directory = self.source.directory(PROCESSOR_PATTERNS)
        # The PIL backend everywhere, so pixels (and mm_hash) do not depend on whether torchvision is installed.
        return QwenProcessor(self.load_tokenizer(), AutoImageProcessor.from_pretrained(directory, backend="pil"))

    def load_tokenizer(self) -> Any:
        return AutoTokenizer.from_pretrained(self.source.directory(PROCESSOR_PATTERNS))

    def _weights(self) -> SafetensorsCheckpoint:
        return SafetensorsCheckpoint(self.source.directory(WEIGHT_PATTERNS))

    def load_vision(self, device: torch.device, dtype: torch.dtype) -> QwenVisionEncoder:
        with init_empty_weights():
            encoder = QwenVisionEncoder(self._parts.tower, copy.deepcopy(self.config.vision_config))
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
        )
        return model.eval().requires_grad_(False)

    def load_full_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        directory = self.source.directory(WEIGHT_PATTERNS + PROCESSOR_PATTERNS)
        model = AutoModelForImageTextToText.from_pretrained(directory, dtype=dtype)
        return model.to(device).eval()


_SHAPE_REFUSED = "The image's aspect ratio is too extreme for this model (at most 200:1)."

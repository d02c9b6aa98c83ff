"""The model-adapter interface: how one family's checkpoint splits for disaggregated serving.

Each family (``llava.py``, ``qwen_vl.py``) implements ``ModelAdapter``;
``families.load_adapter`` picks one by the config's ``model_type``. Services
and policy code see only this interface. Its torch-free half (configs,
tokenizer, image processor) is ``processing.ModelProcessing``, all the proxy uses.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn
from transformers import PreTrainedModel

from .processing import ModelProcessing


class ModelAdapter(ModelProcessing):
    """One checkpoint of one model family, split for disaggregated serving: ``ModelProcessing`` plus the weights."""

    @abstractmethod
    def load_vision(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The vision tower and projector only, in eval mode (see ``vision_io.encode_images``)."""

    @abstractmethod
    def load_language_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        """A causal LM (``.model`` + ``.lm_head``) holding only the LM weights, in eval mode."""

    @abstractmethod
    def load_full_model(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        """The whole HF model, for reference outputs in tests."""


def tied_head(missing: set[str], tied: bool) -> dict[str, str]:
    """With tied embeddings a checkpoint may omit the head: it shares the input embeddings."""
    return {"lm_head.weight": "model.embed_tokens.weight"} if tied and "lm_head.weight" in missing else {}


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters (tied tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())

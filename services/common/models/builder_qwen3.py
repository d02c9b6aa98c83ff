"""Builds random-weight Qwen3-VL and Qwen3-VL-MoE checkpoints (the ``qwen3-vl*`` presets).

The directory has what a hub checkpoint of the family (Qwen/Qwen3-VL-2B-Instruct,
Qwen/Qwen3-VL-30B-A3B-Instruct) has: ``config.json``, ``model.safetensors`` in
the published key layout (``model.language_model.*``, ``model.visual.*``,
``lm_head.*``), ``generation_config.json``, the tokenizer, the image processor
(``preprocessor_config.json``: 16-pixel patches, mean and std 0.5), the video
processor's settings (``video_preprocessor_config.json``), ``chat_template.jinja``
and ``processor_config.json``.

The published MoE checkpoints store each layer's experts fused and transposed,
``experts.gate_up_proj`` as ``[experts, hidden, 2 * moe_intermediate]`` and
``experts.down_proj`` as ``[experts, moe_intermediate, hidden]``; transformers'
modules hold the other order (its loader transposes what does not fit, and its
``save_pretrained`` writes the module order). The builder writes the published
order, so the loaders here are exercised on what a real checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from .builder_qwen import common_vision_config, qwen_image_processor, vl_config, write_processor, write_weights
from .chat_template import QWEN3_VL_CHAT_TEMPLATE
from .loading import QWEN3_MOE_EXPERT_TENSORS, SINGLE_FILE
from .presets import Preset

QWEN3_MEAN = QWEN3_STD = (0.5, 0.5, 0.5)
"""Qwen3-VL's pixel normalisation (images and videos): to [-1, 1]."""

# Per family: config class, model class.
_FAMILIES: dict[str, tuple[type[Qwen3VLConfig | Qwen3VLMoeConfig], type[PreTrainedModel]]] = {
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
    "qwen3_vl_moe": (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration),
}
PROCESSOR_CLASS = "Qwen3VLProcessor"


def _vision_config(preset: Preset) -> dict:
    vision = preset.qwen_vision
    return dict(
        common_vision_config(vision),
        hidden_size=vision.hidden_size,
        intermediate_size=vision.intermediate_size,
        out_hidden_size=preset.text.hidden_size,
        num_position_embeddings=vision.num_position_embeddings,
        deepstack_visual_indexes=list(vision.deepstack_layers),
    )


def qwen3_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The model config of a ``qwen3-vl*`` preset: explicit head size, interleaved multimodal RoPE, MoE shape."""
    text = preset.text
    text_extra: dict = dict(head_dim=text.head_dim or text.hidden_size // text.num_heads)
    if preset.family == "qwen3_vl_moe":
        text_extra.update(
            num_experts=text.num_experts,
            num_experts_per_tok=text.num_experts_per_tok,
            moe_intermediate_size=text.moe_intermediate_size,
            decoder_sparse_step=1,
        )
    return vl_config(
        _FAMILIES[preset.family][0],
        preset,
        tokenizer,
        _vision_config(preset),
        text_extra=text_extra,
        rope_extra={"mrope_interleaved": True},
    )


def video_processor_config(preset: Preset) -> dict:
    """``video_preprocessor_config.json``: Qwen3VLVideoProcessor's settings as the hub checkpoints write them.

    A video's pixel budget covers all its sampled frames (``size``: min and max
    of frames x height x width); frames are sampled at ``fps`` a second, between
    ``min_frames`` and ``max_frames``.
    """
    vision = preset.qwen_vision
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_sample_frames": True,
        "fps": 2,
        "image_mean": list(QWEN3_MEAN),
        "image_std": list(QWEN3_STD),
        "max_frames": 768,
        "merge_size": vision.merge_size,
        "min_frames": 4,
        "patch_size": vision.patch_size,
        "processor_class": PROCESSOR_CLASS,
        "resample": 3,
        "rescale_factor": 1 / 255,
        # A video's budget is over all its frames: at least 8 and at most 16 of the image bounds.
        "size": {"longest_edge": vision.max_pixels * 16, "shortest_edge": vision.min_pixels * 8},
        "temporal_patch_size": vision.temporal_patch_size,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }


def write_qwen3_checkpoint(preset: Preset, out_dir: Path, seed: int, progress: Callable[[str], None]) -> None:
    """Writes the whole checkpoint of a ``qwen3-vl*`` preset into ``out_dir``."""
    tokenizer = write_weights(preset, out_dir, seed, progress, qwen3_config, _FAMILIES[preset.family][1])
    if preset.family == "qwen3_vl_moe":
        transpose_experts(Path(out_dir) / SINGLE_FILE)
    write_processor(
        Path(out_dir),
        tokenizer,
        qwen_image_processor(preset, QWEN3_MEAN, QWEN3_STD),
        QWEN3_VL_CHAT_TEMPLATE,
        PROCESSOR_CLASS,
        video_config=video_processor_config(preset),
    )


def transpose_experts(weights: Path) -> None:
    """Rewrites ``weights`` with its fused expert tensors in the published order (module docstring)."""
    with safe_open(weights, framework="pt") as handle:
        metadata = handle.metadata()
        keys = list(handle.keys())
        tensors = {key: handle.get_tensor(key) for key in keys}
    for key, tensor in tensors.items():
        if key.endswith(QWEN3_MOE_EXPERT_TENSORS):
            tensors[key] = tensor.transpose(1, 2).contiguous()
    save_file(tensors, weights, metadata=metadata)

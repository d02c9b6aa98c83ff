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

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from .chat_template import QWEN3_VL_CHAT_TEMPLATE
from .init_weights import initialise_vlm
from .loading import QWEN3_MOE_EXPERT_TENSORS, SINGLE_FILE
from .presets import Preset
from .tokenizer import (
    ENDOFTEXT,
    IM_END,
    IMAGE_PAD,
    QWEN_SPECIAL_TOKENS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    build_qwen_tokenizer,
    token_id,
    token_ids,
)

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
        depth=vision.num_layers,
        hidden_size=vision.hidden_size,
        intermediate_size=vision.intermediate_size,
        num_heads=vision.num_heads,
        patch_size=vision.patch_size,
        spatial_merge_size=vision.merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        out_hidden_size=preset.text.hidden_size,
        num_position_embeddings=vision.num_position_embeddings,
        deepstack_visual_indexes=list(vision.deepstack_layers),
    )


def qwen3_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> Qwen3VLConfig | Qwen3VLMoeConfig:
    """The model config of a ``qwen3-vl*`` preset (untied embeddings, as the weight initialisation needs)."""
    text = preset.text
    ids = {token: token_id(tokenizer, token) for token in QWEN_SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_layers,
        num_attention_heads=text.num_heads,
        num_key_value_heads=text.num_kv_heads,
        head_dim=text.head_dim or text.hidden_size // text.num_heads,
        max_position_embeddings=text.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": text.rope_theta,
            "mrope_section": list(text.mrope_section),
            "mrope_interleaved": True,
        },
        bos_token_id=None,
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        tie_word_embeddings=False,
    )
    if preset.family == "qwen3_vl_moe":
        text_config.update(
            num_experts=text.num_experts,
            num_experts_per_tok=text.num_experts_per_tok,
            moe_intermediate_size=text.moe_intermediate_size,
            decoder_sparse_step=1,
        )
    return _FAMILIES[preset.family][0](
        vision_config=_vision_config(preset),
        text_config=text_config,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )


def qwen3_image_processor(preset: Preset) -> Qwen2VLImageProcessorPil:
    """Qwen3-VL's image processor: Qwen2-VL's dynamic resolution with its own patch size and normalisation."""
    vision = preset.qwen_vision
    return Qwen2VLImageProcessorPil(
        min_pixels=vision.min_pixels,
        max_pixels=vision.max_pixels,
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.merge_size,
        image_mean=list(QWEN3_MEAN),
        image_std=list(QWEN3_STD),
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
    progress(f"training tokenizer ({preset.tokenizer_vocab_size} tokens)")
    tokenizer = build_qwen_tokenizer(preset.tokenizer_vocab_size, preset.corpus_lines, seed)
    config = qwen3_config(preset, tokenizer)
    progress("initialising weights")
    with torch.device("meta"):
        model = _FAMILIES[preset.family][1](config)
    model = model.to_empty(device="cpu")  # every parameter is written below; buffers are not saved
    special_ids = token_ids(tokenizer, list(QWEN_SPECIAL_TOKENS))
    initialise_vlm(model, special_ids, seed, preset.context_strength)
    eos = token_ids(tokenizer, [IM_END, ENDOFTEXT])
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1])
    progress("saving weights")
    model.save_pretrained(out_dir, safe_serialization=True)
    if preset.family == "qwen3_vl_moe":
        transpose_experts(Path(out_dir) / SINGLE_FILE)
    _write_processor(preset, tokenizer, Path(out_dir))


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


def _write_processor(preset: Preset, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    # As for Qwen2-VL: the processor object needs torchvision (its video half), so its files are written one by one.
    tokenizer.save_pretrained(out_dir)
    image_processor = qwen3_image_processor(preset)
    image_processor.save_pretrained(out_dir)
    video_config = video_processor_config(preset)
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").write_text(QWEN3_VL_CHAT_TEMPLATE)
    processor_config = {
        "image_processor": image_processor.to_dict(),
        "video_processor": video_config,
        "processor_class": PROCESSOR_CLASS,
    }
    (out_dir / "processor_config.json").write_text(json.dumps(processor_config, indent=2, sort_keys=True) + "\n")

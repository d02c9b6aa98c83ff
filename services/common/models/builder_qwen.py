"""Builds random-weight Qwen2-VL and Qwen2.5-VL checkpoints (the ``qwen*`` presets).

The directory has what a hub checkpoint of the family has: ``config.json``,
``model.safetensors`` (transformers 5 key layout), ``generation_config.json``,
the tokenizer with ChatML and vision markers, ``preprocessor_config.json`` (the
dynamic-resolution image processor), ``chat_template.jinja`` and
``processor_config.json`` naming the processor class. Weights are initialised
like LLaVA's (``init_weights.py``): greedy choices keep wide margins.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from .chat_template import QWEN_VL_CHAT_TEMPLATE
from .init_weights import initialise_vlm
from .presets import CLIP_MEAN, CLIP_STD, Preset, QwenVisionShape
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

# Per family: config class, model class, processor class name (as processor_config.json names it).
_FAMILIES: dict[
    str,
    tuple[
        type[Qwen2_5_VLConfig | Qwen2VLConfig],
        type[PreTrainedModel],
        str,
    ],
] = {
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, "Qwen2_5_VLProcessor"),
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration, "Qwen2VLProcessor"),
}
# CLIP's normalisation constants, as Qwen2-VL's image processor uses them.


def _vision_config(preset: Preset) -> dict:
    vision: QwenVisionShape = preset.qwen_vision
    common = dict(
        depth=vision.num_layers,
        num_heads=vision.num_heads,
        patch_size=vision.patch_size,
        spatial_merge_size=vision.merge_size,
        temporal_patch_size=vision.temporal_patch_size,
    )
    if preset.family == "qwen2_vl":
        # Qwen2-VL names the tower's width embed_dim and the merger's output hidden_size.
        return dict(
            common,
            embed_dim=vision.hidden_size,
            hidden_size=preset.text.hidden_size,
            mlp_ratio=vision.intermediate_size // vision.hidden_size,
        )
    return dict(
        common,
        hidden_size=vision.hidden_size,
        intermediate_size=vision.intermediate_size,
        out_hidden_size=preset.text.hidden_size,
        window_size=vision.window_size,
        fullatt_block_indexes=list(vision.full_attention_layers),
    )


def qwen_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> Qwen2_5_VLConfig | Qwen2VLConfig:
    """The model config of a ``qwen*`` preset (untied embeddings, as the weight initialisation needs)."""
    text = preset.text
    config_class = _FAMILIES[preset.family][0]
    ids = {token: token_id(tokenizer, token) for token in QWEN_SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_layers,
        num_attention_heads=text.num_heads,
        num_key_value_heads=text.num_kv_heads,
        max_position_embeddings=text.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": text.rope_theta,
            "mrope_section": list(text.mrope_section),
        },
        bos_token_id=None,
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        tie_word_embeddings=False,
    )
    return config_class(
        vision_config=_vision_config(preset),
        text_config=text_config,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )


def qwen_image_processor(preset: Preset) -> Qwen2VLImageProcessorPil:
    """The dynamic-resolution image processor (aspect ratio kept, pixel count within bounds)."""
    vision = preset.qwen_vision
    return Qwen2VLImageProcessorPil(
        min_pixels=vision.min_pixels,
        max_pixels=vision.max_pixels,
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.merge_size,
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    )


def write_qwen_checkpoint(preset: Preset, out_dir: Path, seed: int, progress: Callable[[str], None]) -> None:
    """Writes the whole checkpoint of a ``qwen*`` preset into ``out_dir``."""
    progress(f"training tokenizer ({preset.tokenizer_vocab_size} tokens)")
    tokenizer = build_qwen_tokenizer(preset.tokenizer_vocab_size, preset.corpus_lines, seed)
    config = qwen_config(preset, tokenizer)
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
    _write_processor(preset, tokenizer, Path(out_dir))


def _write_processor(preset: Preset, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    # The processor object itself cannot be built without torchvision (its video
    # half needs it), so its files are written one by one, as a hub checkpoint has them.
    tokenizer.save_pretrained(out_dir)
    image_processor = qwen_image_processor(preset)
    image_processor.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(QWEN_VL_CHAT_TEMPLATE)
    processor_config = {"image_processor": image_processor.to_dict(), "processor_class": _FAMILIES[preset.family][2]}
    (out_dir / "processor_config.json").write_text(json.dumps(processor_config, indent=2, sort_keys=True) + "\n")

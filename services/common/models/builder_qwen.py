"""Builds random-weight Qwen2-VL and Qwen2.5-VL checkpoints (the ``qwen*`` presets).

The directory has what a hub checkpoint of the family has: ``config.json``,
``model.safetensors`` (transformers 5 key layout), ``generation_config.json``,
the tokenizer with ChatML and vision markers, ``preprocessor_config.json`` (the
dynamic-resolution image processor), ``chat_template.jinja`` and
``processor_config.json`` naming the processor class. Weights are initialised
like LLaVA's (``init_weights.py``): greedy choices keep wide margins. The parts
every Qwen VL family builds alike (config, image processor, weights, processor
files) serve ``builder_qwen3.py`` too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from .chat_template import QWEN_VL_CHAT_TEMPLATE
from .configs import text_config_of
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


def common_vision_config(vision: QwenVisionShape) -> dict:
    """The vision-config keys every Qwen VL family (2, 2.5, 3) names alike."""
    return dict(
        depth=vision.num_layers,
        num_heads=vision.num_heads,
        patch_size=vision.patch_size,
        spatial_merge_size=vision.merge_size,
        temporal_patch_size=vision.temporal_patch_size,
    )


def _vision_config(preset: Preset) -> dict:
    vision: QwenVisionShape = preset.qwen_vision
    common = common_vision_config(vision)
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


def vl_config(
    config_class: Callable[..., PretrainedConfig],
    preset: Preset,
    tokenizer: PreTrainedTokenizerFast,
    vision_config: dict,
    text_extra: dict | None = None,
    rope_extra: dict | None = None,
) -> PretrainedConfig:
    """A Qwen VL family's model config (untied embeddings, as the weight initialisation needs).

    ``text_extra`` and ``rope_extra`` add the keys a family has beyond the ones
    all of them share.
    """
    text = preset.text
    ids = {token: token_id(tokenizer, token) for token in QWEN_SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=max(len(tokenizer), preset.lm_vocab_size),
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
            **(rope_extra or {}),
        },
        bos_token_id=None,
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        tie_word_embeddings=False,
        **(text_extra or {}),
    )
    return config_class(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )


def qwen_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The model config of a ``qwen*`` preset."""
    return vl_config(_FAMILIES[preset.family][0], preset, tokenizer, _vision_config(preset))


def qwen_image_processor(
    preset: Preset, mean: tuple[float, ...] = CLIP_MEAN, std: tuple[float, ...] = CLIP_STD
) -> Qwen2VLImageProcessorPil:
    """The dynamic-resolution image processor (aspect ratio kept, pixel count within bounds).

    Normalises with ``mean`` and ``std`` (CLIP's unless a family has its own).
    """
    vision = preset.qwen_vision
    return Qwen2VLImageProcessorPil(
        min_pixels=vision.min_pixels,
        max_pixels=vision.max_pixels,
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.merge_size,
        image_mean=list(mean),
        image_std=list(std),
    )


def write_weights(
    preset: Preset,
    out_dir: Path,
    seed: int,
    progress: Callable[[str], None],
    config_of: Callable[[Preset, PreTrainedTokenizerFast], PretrainedConfig],
    model_class: type[PreTrainedModel],
) -> PreTrainedTokenizerFast:
    """Trains the tokenizer, then writes the weights and generation config of a ``model_class`` of
    ``config_of(preset, tokenizer)`` into ``out_dir``; returns the tokenizer."""
    progress(f"training tokenizer ({preset.tokenizer_vocab_size} tokens)")
    tokenizer = build_qwen_tokenizer(preset.tokenizer_vocab_size, preset.corpus_lines, seed)
    config = config_of(preset, tokenizer)
    from .builder import build_device  # here: builder imports this module

    device, dtype = build_device(preset)
    progress(f"initialising weights on {device} in {str(dtype).removeprefix('torch.')}")
    with torch.device("meta"):
        # float32 is the default; naming it would add a "dtype" entry to config.json.
        model = model_class(config) if dtype == torch.float32 else model_class._from_config(config, dtype=dtype)
    model = model.to_empty(device=device)  # every parameter is written below; buffers are not saved
    # Rows past the tokenizer's (a padded vocabulary) count as special: never sampled.
    vocab_size = text_config_of(config).vocab_size
    special_ids = [*token_ids(tokenizer, list(QWEN_SPECIAL_TOKENS)), *range(len(tokenizer), vocab_size)]
    initialise_vlm(model, special_ids, seed, preset.context_strength)
    eos = token_ids(tokenizer, [IM_END, ENDOFTEXT])
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1])
    progress("saving weights")
    model.save_pretrained(out_dir, safe_serialization=True)
    return tokenizer


def write_processor(
    out_dir: Path,
    tokenizer: PreTrainedTokenizerFast,
    image_processor: Qwen2VLImageProcessorPil,
    chat_template: str,
    processor_class: str,
    video_config: dict | None = None,
) -> None:
    """Writes the processor's files (tokenizer, image and video processors, chat template, processor class).

    The processor object itself cannot be built without torchvision (its video
    half needs it), so its files are written one by one, as a hub checkpoint has them.
    """
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    processor_config: dict = {"image_processor": image_processor.to_dict(), "processor_class": processor_class}
    if video_config is not None:
        _write_json(out_dir / "video_preprocessor_config.json", video_config)
        processor_config["video_processor"] = video_config
    (out_dir / "chat_template.jinja").write_text(chat_template)
    _write_json(out_dir / "processor_config.json", processor_config)


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def write_qwen_checkpoint(preset: Preset, out_dir: Path, seed: int, progress: Callable[[str], None]) -> None:
    """Writes the whole checkpoint of a ``qwen*`` preset into ``out_dir``."""
    _, model_class, processor_class = _FAMILIES[preset.family]
    tokenizer = write_weights(preset, out_dir, seed, progress, qwen_config, model_class)
    write_processor(Path(out_dir), tokenizer, qwen_image_processor(preset), QWEN_VL_CHAT_TEMPLATE, processor_class)

"""Builds real, random-weight checkpoints offline (``epd make-model``).

The output is an ordinary Hugging Face directory: ``config.json``,
``model.safetensors``, tokenizer, image processor, processor config with the
chat template, and ``generation_config.json``. ``AutoProcessor`` and
``AutoModelForImageTextToText.from_pretrained`` load it like any hub
checkpoint of its family (LLaVA here; Qwen2-VL / Qwen2.5-VL in
``builder_qwen.py``, Qwen3-VL in ``builder_qwen3.py``), with its tensors named
as the family's published checkpoints name them (``key_layout.py``), so other
engines load it unchanged. The same preset and seed always give byte-identical
weights.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    SiglipImageProcessorPil,
    SiglipVisionConfig,
)

from .builder_qwen import write_qwen_checkpoint
from .builder_qwen3 import write_qwen3_checkpoint
from .cache import is_built, resolve_model
from .chat_template import LLAVA_CHAT_TEMPLATE
from .configs import text_config_of
from .init_weights import initialise_vlm
from .key_layout import llava_hf_key, rewrite_keys
from .presets import CLIP_MEAN, CLIP_STD, Preset, get_preset
from .tokenizer import IMAGE, build_hf_tokenizer, token_id

logger = logging.getLogger(__name__)


def _vision_config(preset: Preset) -> CLIPVisionConfig | SiglipVisionConfig:
    vision = preset.llava_vision
    shape: dict[str, Any] = dict(
        hidden_size=vision.hidden_size,
        num_hidden_layers=vision.num_layers,
        num_attention_heads=vision.num_heads,
        intermediate_size=vision.intermediate_size,
        image_size=vision.image_size,
        patch_size=vision.patch_size,
    )
    if vision.kind == "siglip":
        return SiglipVisionConfig(**shape)
    return CLIPVisionConfig(**shape, projection_dim=vision.hidden_size)


def _siglip(preset: Preset) -> bool:
    return preset.llava_vision.kind == "siglip"


def llava_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> LlavaConfig:
    """A llava-1.5-style config (second-to-last vision layer; CLIP's CLS dropped) for ``preset``."""
    return _llava_config(
        preset,
        len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        image_token_id=token_id(tokenizer, IMAGE),
    )


def _llava_config(
    preset: Preset,
    num_tokens: int,
    *,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
    image_token_id: int,
) -> LlavaConfig:
    text = preset.text
    text_config = LlamaConfig(
        vocab_size=max(num_tokens, preset.lm_vocab_size),
        hidden_size=text.hidden_size,
        num_hidden_layers=text.num_layers,
        num_attention_heads=text.num_heads,
        num_key_value_heads=text.num_kv_heads,
        intermediate_size=text.intermediate_size,
        max_position_embeddings=text.max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=_vision_config(preset),
        text_config=text_config,
        image_token_index=image_token_id,  # what LlavaConfig calls image_token_id
        image_seq_length=preset.num_image_tokens,
        vision_feature_layer=-2,
        # SigLIP has no CLS token: every patch is an image token.
        vision_feature_select_strategy="full" if _siglip(preset) else "default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )


def num_parameters(preset: Preset) -> int:
    """Parameters of a LLaVA ``preset``'s checkpoint, counted on the meta device (nothing is allocated).

    The LM's vocabulary is taken at ``lm_vocab_size`` or the tokenizer's target size.
    """
    config = _llava_config(
        preset, preset.tokenizer_vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None, image_token_id=0
    )
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    return sum(parameter.numel() for parameter in model.parameters())


def llava_processor(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> LlavaProcessor:
    """Tokenizer + image processor + chat template.

    CLIP: shortest-edge resize and centre crop, CLIP's normalisation; SigLIP:
    a plain resize to the square input size, normalised to [-1, 1].
    """
    size = preset.llava_vision.image_size
    image_processor: SiglipImageProcessorPil | CLIPImageProcessorPil
    if _siglip(preset):
        image_processor = SiglipImageProcessorPil(size={"height": size, "width": size})
    else:
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": size},
            crop_size={"height": size, "width": size},
            image_mean=list(CLIP_MEAN),
            image_std=list(CLIP_STD),
        )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=preset.vision.patch_size,
        vision_feature_select_strategy="full" if _siglip(preset) else "default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token=IMAGE,
        num_additional_image_tokens=0 if _siglip(preset) else 1,  # CLIP's CLS token, which "default" drops
    )


def _write_checkpoint(preset: Preset, out_dir: Path, seed: int, progress: Callable[[str], None]) -> None:
    if preset.family == "llava":
        _write_llava_checkpoint(preset, out_dir, seed, progress)
    elif preset.family.startswith("qwen3"):
        write_qwen3_checkpoint(preset, out_dir, seed, progress)
    else:
        write_qwen_checkpoint(preset, out_dir, seed, progress)


def _write_llava_checkpoint(preset: Preset, out_dir: Path, seed: int, progress: Callable[[str], None]) -> None:
    device, dtype = build_device(preset)  # first: a machine that cannot build it is told at once
    progress(f"training tokenizer ({preset.tokenizer_vocab_size} tokens)")
    tokenizer = build_hf_tokenizer(preset.tokenizer_vocab_size, preset.corpus_lines, seed)
    config = llava_config(preset, tokenizer)
    progress(f"initialising weights on {device} in {str(dtype).removeprefix('torch.')}")
    with torch.device("meta"):
        # float32 is the default; naming it would add a "dtype" entry to config.json.
        model = (
            LlavaForConditionalGeneration(config)
            if dtype == torch.float32
            else LlavaForConditionalGeneration._from_config(config, dtype=dtype)
        )
    # Built only to be saved: initialise_vlm writes every parameter, and the
    # non-persistent buffers that to_empty leaves unset are never saved.
    model = model.to_empty(device=device)
    # Rows past the tokenizer's (a padded vocabulary) count as special: never sampled.
    never_sampled = [*tokenizer.all_special_ids, *range(len(tokenizer), text_config_of(config).vocab_size)]
    initialise_vlm(model, never_sampled, seed, preset.context_strength)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    progress("saving weights")
    model.save_pretrained(out_dir, safe_serialization=True)
    rewrite_keys(out_dir, llava_hf_key)  # the layout llava-hf publishes, which every loader reads
    llava_processor(preset, tokenizer).save_pretrained(out_dir)


def build_device(preset: Preset) -> tuple[torch.device, torch.dtype]:
    """Where and in which dtype ``preset``'s weights are made; ValueError when this machine cannot."""
    if preset.build_device == "cpu":
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        # Counted on the meta device for LLaVA; the Qwen configs need the trained tokenizer first.
        size = (
            f"{num_parameters(preset) / 1e9:.2f}B parameters, about {2 * num_parameters(preset) / 1e9:.0f} GB"
            if preset.family == "llava"
            else "billions of parameters"
        )
        raise ValueError(
            f"the {preset.name} preset is built on a CUDA device in bfloat16 ({size}; in float32 they do not fit "
            "a CPU machine's memory), and this machine has no CUDA device: build it on a GPU machine"
        )
    return torch.device("cuda"), torch.bfloat16


def build_checkpoint(
    preset: str,
    out_dir: Path,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> Path:
    """Build ``preset`` into ``out_dir`` atomically and return ``out_dir``.

    The checkpoint is written to a temporary directory beside ``out_dir`` and
    renamed into place, so readers never see half of one. If another builder
    finished first, its (identical) result is kept. An existing non-empty
    ``out_dir`` raises ``FileExistsError`` unless ``overwrite`` is set.
    """
    spec = get_preset(preset)
    out_dir = Path(out_dir).expanduser()
    if _is_populated(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; pass overwrite=True to replace it")
    report = progress or (lambda message: logger.info("make-model %s: %s", preset, message))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a model cache is meant to be shared
    try:
        _write_checkpoint(spec, staging, seed, report)
        _publish(staging, out_dir, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report(f"done: {out_dir}")
    return out_dir


def _is_populated(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _publish(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename ``staging`` to ``out_dir``; a concurrent winner's directory is kept."""
    if overwrite and _is_populated(out_dir):
        retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, retired / out_dir.name)
        shutil.rmtree(retired, ignore_errors=True)
    if out_dir.is_dir() and not _is_populated(out_dir):
        out_dir.rmdir()  # an empty directory (e.g. made by the user) is not a checkpoint
    try:
        os.rename(staging, out_dir)
    except OSError:
        if not is_built(out_dir):
            raise
        logger.info("another builder published %s first; keeping it", out_dir)


def ensure_model(preset_or_path: str | None, progress: Callable[[str], None] | None = None) -> Path | str:
    """Resolve ``--model`` (``cache.resolve_model``), building a missing preset here, in this process."""

    def build(name: str, target: Path) -> None:
        try:
            build_checkpoint(name, target, progress=progress)
        except FileExistsError:
            if not is_built(target):  # not a concurrent builder's result
                raise

    return resolve_model(preset_or_path, build)

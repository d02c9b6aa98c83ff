"""The checkpoint builder: determinism, HF loadability, chat template, tokenizer, atomic publish."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from services.common.models import build_checkpoint, default_model_dir, ensure_model, get_preset
from services.common.models.tokenizer import IMAGE


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_gives_byte_identical_checkpoint(models_tiny_dir: Path, tmp_path: Path):
    again = build_checkpoint("tiny", tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert _sha256(again / name) == _sha256(models_tiny_dir / name), name


def test_other_seed_gives_other_weights(models_tiny_dir: Path, tmp_path: Path):
    other = build_checkpoint("tiny", tmp_path / "other", seed=1)
    assert _sha256(other / "model.safetensors") != _sha256(models_tiny_dir / "model.safetensors")


def test_config_is_llava_15_style(models_tiny_dir: Path):
    config = AutoConfig.from_pretrained(models_tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(models_tiny_dir)
    preset = get_preset("tiny")
    assert config.model_type == "llava"
    assert config.vision_feature_layer == -2
    assert config.vision_feature_select_strategy == "default"
    assert config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE)
    assert config.text_config.vocab_size == len(tokenizer)
    assert config.text_config.num_key_value_heads == preset.text.num_kv_heads
    assert config.vision_config.image_size == preset.vision.image_size


def test_tokenizer_round_trips_text_and_keeps_image_token_whole(models_tiny_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(models_tiny_dir)
    texts = ["Hello, world!", "  two  spaces\nand\ttabs ", "日本語 café 🙂 naïve", "x" * 300, '{"a": [1, 2]}']
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text
    ids = tokenizer(f"a{IMAGE}{IMAGE}\nb")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.convert_tokens_to_ids(IMAGE)) == 2


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
            "USER: <image>\nWhat is it? ASSISTANT:",
        ),
        ([{"role": "user", "content": "Hi"}], "USER: Hi ASSISTANT:"),
        (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
                {"role": "assistant", "content": "C"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "image"}]},
            ],
            "Be brief. USER: A B ASSISTANT: C</s>USER: <image>\n<image>\n ASSISTANT:",
        ),
    ],
)
def test_chat_template_renders_llava_15_format(models_tiny_dir: Path, messages, expected):
    processor = AutoProcessor.from_pretrained(models_tiny_dir)
    assert processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected
    without = processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == expected.removesuffix("ASSISTANT:")


def test_processor_expands_each_image_to_its_token_count(models_tiny_dir: Path):
    processor = AutoProcessor.from_pretrained(models_tiny_dir)
    images = [Image.new("RGB", (50, 40), (200, 10, 10)), Image.new("L", (7, 90), 128)]
    out = processor(text=f"USER: {IMAGE}\nx {IMAGE}\ny ASSISTANT:", images=images, return_tensors="pt")
    image_token_id = processor.tokenizer.convert_tokens_to_ids(IMAGE)
    assert int((out["input_ids"] == image_token_id).sum()) == 2 * get_preset("tiny").num_image_tokens
    size = get_preset("tiny").vision.image_size
    assert tuple(out["pixel_values"].shape) == (2, 3, size, size)


def test_existing_directory_is_not_overwritten_unless_asked(models_tiny_dir: Path, tmp_path: Path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_checkpoint("tiny", target)
    build_checkpoint("tiny", target, overwrite=True)
    assert not (target / "keep.txt").exists()
    assert _sha256(target / "model.safetensors") == _sha256(models_tiny_dir / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging leftovers


def test_unknown_preset_is_rejected(tmp_path: Path):
    with pytest.raises(KeyError, match="tiny"):
        build_checkpoint("huge", tmp_path / "x")


def test_default_model_dir_reads_environment_when_called(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    assert default_model_dir("bench") == tmp_path / "models" / "bench-v3"
    monkeypatch.delenv("EPD_CACHE_DIR")
    assert default_model_dir() == Path("~/.cache/epd/models/tiny-v3").expanduser()


def test_ensure_model_builds_once_even_when_raced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_model(None))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = default_model_dir("tiny")
    assert results == [target, target]
    assert (target / "model.safetensors").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny-v3"]
    assert ensure_model("tiny") == target


def test_ensure_model_passes_directories_and_hub_ids_through(models_tiny_dir: Path):
    assert ensure_model(str(models_tiny_dir)) == models_tiny_dir
    assert ensure_model("llava-hf/llava-1.5-7b-hf") == "llava-hf/llava-1.5-7b-hf"


def test_llava_15_7b_preset_has_llava_15_7b_shapes():
    # Shapes only: counted on the meta device, no weights built (the preset is built on a GPU, never in CI).
    from services.common.models.builder import _llava_config, build_device, num_parameters

    preset = get_preset("llava-1.5-7b-random")
    config = _llava_config(
        preset, preset.tokenizer_vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=3, image_token_id=4
    )
    text, vision = config.text_config, config.vision_config
    assert (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.intermediate_size,
        text.vocab_size,
    ) == (4096, 32, 32, 32, 11008, 32064)
    assert (
        vision.hidden_size,
        vision.num_hidden_layers,
        vision.num_attention_heads,
        vision.intermediate_size,
        vision.image_size,
        vision.patch_size,
    ) == (1024, 24, 16, 4096, 336, 14)
    assert config.image_seq_length == preset.num_image_tokens == 576
    assert num_parameters(preset) == 7_063_427_072  # LLaVA-1.5-7B's 7.06B
    assert build_device(get_preset("tiny")) == (torch.device("cpu"), torch.float32)


def test_qwen2_5_vl_7b_preset_has_qwen2_5_vl_7b_shapes():
    # Counted on the meta device with a small tokenizer: the padded vocabulary is the LM's 152064 rows either way.
    from services.common.models.builder import build_device
    from services.common.models.builder_qwen import _FAMILIES, qwen_config
    from services.common.models.tokenizer import build_qwen_tokenizer

    preset = get_preset("qwen2.5-vl-7b-random")
    config = qwen_config(preset, build_qwen_tokenizer(1000, 3000, 0))
    with torch.device("meta"):
        model = _FAMILIES[preset.family][1](config)
    assert sum(p.numel() for p in model.parameters()) == 8_292_166_656  # Qwen2.5-VL-7B-Instruct's 8.29B
    assert config.text_config.vocab_size == 152064
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            build_device(preset)


def test_llava_checkpoint_keys_are_in_llava_hf_layout_and_load_unchanged(models_tiny_dir: Path):
    """Other engines (vLLM, SGLang) read llava-hf's names: the vision tower sits under ``vision_model``."""
    import torch
    from safetensors import safe_open
    from transformers import LlavaForConditionalGeneration

    with safe_open(models_tiny_dir / "model.safetensors", framework="pt") as handle:
        keys = list(handle.keys())
        projector = handle.get_tensor("multi_modal_projector.linear_1.weight")
    prefixes = {
        "vision_tower.vision_model.",
        "multi_modal_projector.",
        "language_model.model.",
        "language_model.lm_head.",
    }
    assert keys and all(any(key.startswith(p) for p in prefixes) for key in keys)
    assert any(key.startswith("vision_tower.vision_model.") for key in keys)
    model, info = LlavaForConditionalGeneration.from_pretrained(models_tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.model.multi_modal_projector.linear_1.weight, projector)


def test_llava_hf_key_maps_every_layout_onto_the_published_one():
    from services.common.models.key_layout import llava_hf_key

    assert llava_hf_key("vision_tower.embeddings.x") == "vision_tower.vision_model.embeddings.x"
    assert llava_hf_key("vision_tower.vision_model.embeddings.x") == "vision_tower.vision_model.embeddings.x"
    assert llava_hf_key("model.vision_tower.encoder.y") == "vision_tower.vision_model.encoder.y"
    assert llava_hf_key("model.language_model.layers.0.z") == "language_model.model.layers.0.z"
    assert llava_hf_key("lm_head.weight") == "language_model.lm_head.weight"
    assert llava_hf_key("language_model.lm_head.weight") == "language_model.lm_head.weight"
    assert llava_hf_key("model.multi_modal_projector.linear_1.bias") == "multi_modal_projector.linear_1.bias"

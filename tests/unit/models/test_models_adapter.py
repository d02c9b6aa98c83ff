"""Split loading: each half holds exactly its weights and computes what the full model computes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from services.common.models import (
    MissingWeightsError,
    Part,
    count_parameters,
    get_preset,
    load_adapter,
    split_checkpoint_key,
)

CPU = torch.device("cpu")


def _checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(directory / "model.safetensors", framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - safe_open is no dict


def _copy_with_tensors(source: Path, target: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """A copy of ``source`` whose weights are ``tensors``, optionally sharded with an index."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("model.safetensors"))
    if shards == 1:
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
        return target
    keys = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        chunk = keys[shard::shards]
        save_file({k: tensors[k] for k in chunk}, target / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, name))
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target


def _to_transformers5_layout(key: str) -> str:
    """Saved (llava-hf) key -> ``model.language_model.*`` / ``model.vision_tower.*`` layout."""
    if key.startswith("language_model.lm_head."):
        return key.removeprefix("language_model.")
    if key.startswith("language_model.model."):
        return "model.language_model." + key.removeprefix("language_model.model.")
    return "model." + key.replace("vision_tower.vision_model.", "vision_tower.", 1)


def _to_flat_tower_layout(key: str) -> str:
    """Saved key -> the tower one level up (``vision_tower.*``, what transformers 5's save_pretrained writes)."""
    return key.replace("vision_tower.vision_model.", "vision_tower.", 1)


def _pixels(num_images: int, seed: int = 0) -> torch.Tensor:
    size = get_preset("tiny").vision.image_size
    return torch.randn(num_images, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _reference_image_features(full, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(list(full.model.get_image_features(pixel_values=pixel_values).pooler_output))


def test_adapter_reports_model_facts(models_tiny_dir: Path):
    adapter = load_adapter(models_tiny_dir)
    tokenizer = adapter.load_tokenizer()
    preset = get_preset("tiny")
    assert adapter.model_id == "tiny"
    assert adapter.image_token == "<image>"
    assert adapter.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert adapter.eos_token_id == tokenizer.eos_token_id
    assert adapter.hidden_size == preset.text.hidden_size
    assert adapter.max_model_len == preset.text.max_position_embeddings


@pytest.mark.parametrize(("height", "width"), [(32, 32), (480, 640), (5, 900)])
def test_num_image_tokens_matches_processor_expansion(models_tiny_dir: Path, height: int, width: int):
    adapter = load_adapter(models_tiny_dir)
    processor = adapter.load_processor()
    image = Image.new("RGB", (width, height))
    out = processor(text="USER: <image>\nhi ASSISTANT:", images=[image], return_tensors="pt")
    assert int((out["input_ids"] == adapter.image_token_id).sum()) == adapter.num_image_tokens(height, width)
    assert adapter.num_image_tokens(height, width) == get_preset("tiny").num_image_tokens


def test_processor_settings_are_json_and_cover_pixels(models_tiny_dir: Path):
    settings = load_adapter(models_tiny_dir).processor_settings()
    assert json.loads(json.dumps(settings)) == settings
    size = get_preset("tiny").vision.image_size
    assert settings["crop_size"] == {"height": size, "width": size}
    assert settings["size"] == {"shortest_edge": size}
    for key in ("image_mean", "image_std", "resample", "do_rescale", "do_normalize", "do_convert_rgb"):
        assert key in settings


def test_vision_load_holds_exactly_tower_and_projector(models_tiny_dir: Path, models_tiny_full):
    encoder = load_adapter(models_tiny_dir).load_vision(CPU, torch.float32)
    full = models_tiny_full.model
    # LLaVA-1.5 reads the penultimate layer (vision_feature_layer -2): the last one is dropped at load.
    last = len(full.vision_tower.encoder.layers) - 1
    tower = {n: p for n, p in full.vision_tower.named_parameters() if not n.startswith(f"encoder.layers.{last}.")}
    expected = {f"vision_tower.{n}" for n in tower}
    expected |= {f"multi_modal_projector.{n}" for n, _ in full.multi_modal_projector.named_parameters()}
    assert {n for n, _ in encoder.named_parameters()} == expected
    assert len(encoder.vision_tower.encoder.layers) == last and encoder.feature_layers == (last,)
    assert count_parameters(encoder) == sum(p.numel() for p in tower.values()) + count_parameters(
        full.multi_modal_projector
    )
    assert all(p.device == CPU and not p.is_meta for p in encoder.parameters())


def test_language_model_load_holds_exactly_the_lm(models_tiny_dir: Path, models_tiny_full):
    lm = load_adapter(models_tiny_dir).load_language_model(CPU, torch.float32)
    names = {n for n, _ in lm.named_parameters()}
    assert not any("vision" in n or "projector" in n for n in names)
    expected = count_parameters(models_tiny_full.model.language_model) + count_parameters(models_tiny_full.lm_head)
    assert count_parameters(lm) == expected
    assert all(not p.is_meta for p in lm.parameters())
    assert all(not b.is_meta for b in lm.buffers())


def test_vision_encoder_equals_get_image_features(models_tiny_dir: Path, models_tiny_full):
    encoder = load_adapter(models_tiny_dir).load_vision(CPU, torch.float32)
    pixel_values = _pixels(3)
    with torch.no_grad():
        ours = encoder(pixel_values)
    assert ours.shape == (3, get_preset("tiny").num_image_tokens, get_preset("tiny").text.hidden_size)
    torch.testing.assert_close(ours, _reference_image_features(models_tiny_full, pixel_values), rtol=0, atol=1e-6)


def test_language_model_on_spliced_embeddings_equals_full_model(models_tiny_dir: Path, models_tiny_full):
    adapter = load_adapter(models_tiny_dir)
    lm = adapter.load_language_model(CPU, torch.float32)
    encoder = adapter.load_vision(CPU, torch.float32)
    processor = adapter.load_processor()
    text = "USER: <image>\nWhat is in the picture? ASSISTANT:"
    inputs = processor(text=text, images=[Image.new("RGB", (64, 48), (10, 200, 30))], return_tensors="pt")
    with torch.no_grad():
        reference = models_tiny_full(**inputs).logits
        embeds = lm.model.embed_tokens(inputs["input_ids"])
        mask = inputs["input_ids"] == adapter.image_token_id
        embeds[mask] = encoder(inputs["pixel_values"]).reshape(-1, adapter.hidden_size)
        ours = lm(inputs_embeds=embeds).logits
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("convert", "shards"),
    [(_to_transformers5_layout, 1), (_to_flat_tower_layout, 1), (str, 3)],
    ids=["transformers5", "flat-tower", "llava-hf-sharded"],
)
def test_other_key_layouts_load_the_same_weights(models_tiny_dir, models_tiny_full, tmp_path, convert, shards):
    tensors = {convert(k): v for k, v in _checkpoint_tensors(models_tiny_dir).items()}
    copy = _copy_with_tensors(models_tiny_dir, tmp_path / "converted", tensors, shards)
    adapter = load_adapter(copy)
    encoder = adapter.load_vision(CPU, torch.float32)
    lm = adapter.load_language_model(CPU, torch.float32)
    full = models_tiny_full
    pixel_values = _pixels(2, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(encoder(pixel_values), _reference_image_features(full, pixel_values), rtol=0, atol=0)
    for name, param in lm.state_dict().items():
        reference = (
            full.lm_head.weight
            if name == "lm_head.weight"
            else full.model.language_model.get_parameter(name.removeprefix("model."))
        )
        assert torch.equal(param, reference), name


def test_tied_embeddings_checkpoint_without_head_loads(models_tiny_dir: Path, tmp_path: Path):
    tensors = {k: v for k, v in _checkpoint_tensors(models_tiny_dir).items() if "lm_head" not in k}
    copy = _copy_with_tensors(models_tiny_dir, tmp_path / "tied", tensors)
    config = json.loads((copy / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (copy / "config.json").write_text(json.dumps(config))
    lm = load_adapter(copy).load_language_model(CPU, torch.float32)
    assert torch.equal(lm.lm_head.weight, lm.model.embed_tokens.weight)


def test_missing_tensors_are_named_in_the_error(models_tiny_dir: Path, tmp_path: Path):
    tensors = _checkpoint_tensors(models_tiny_dir)
    dropped = ["multi_modal_projector.linear_2.bias", "language_model.model.norm.weight"]
    kept = {k: v for k, v in tensors.items() if k not in dropped}
    copy = _copy_with_tensors(models_tiny_dir, tmp_path / "broken", kept)
    adapter = load_adapter(copy)
    with pytest.raises(MissingWeightsError, match=r"missing 1 tensor\(s\): multi_modal_projector\.linear_2\.bias$"):
        adapter.load_vision(CPU, torch.float32)
    with pytest.raises(MissingWeightsError) as info:
        adapter.load_language_model(CPU, torch.float32)
    assert info.value.names == ["model.norm.weight"]


def test_split_checkpoint_key_covers_both_layouts():
    assert split_checkpoint_key("model.language_model.layers.0.mlp.up_proj.weight") == (
        Part.LANGUAGE_MODEL,
        "model.layers.0.mlp.up_proj.weight",
    )
    assert split_checkpoint_key("language_model.model.norm.weight") == (Part.LANGUAGE_MODEL, "model.norm.weight")
    assert split_checkpoint_key("language_model.lm_head.weight") == (Part.LANGUAGE_MODEL, "lm_head.weight")
    assert split_checkpoint_key("lm_head.weight") == (Part.LANGUAGE_MODEL, "lm_head.weight")
    assert split_checkpoint_key("model.vision_tower.encoder.layers.0.fc1.bias") == (
        Part.VISION_TOWER,
        "encoder.layers.0.fc1.bias",
    )
    assert split_checkpoint_key("multi_modal_projector.linear_1.weight") == (Part.PROJECTOR, "linear_1.weight")
    assert split_checkpoint_key("image_newline") is None


def test_unsupported_family_and_missing_paths_fail_clearly(models_tiny_dir: Path, tmp_path: Path):
    other = tmp_path / "llama"
    other.mkdir()
    config = json.loads((models_tiny_dir / "config.json").read_text())["text_config"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_adapter(other)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_adapter(tmp_path / "nowhere")


def test_unreachable_hub_id_fails_clearly(monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub

    def fake_snapshot_download(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(FileNotFoundError, match="could not be fetched from the Hugging Face hub"):
        load_adapter("llava-hf/llava-1.5-7b-hf")

"""Qwen2-VL / Qwen2.5-VL checkpoints: built, loaded by transformers, split into halves that compute what the whole does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracle_support import encode_three_grids, make_image, whole_and_halves
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from services.cli import main
from services.common.models import (
    Part,
    QwenVLAdapter,
    UnsupportedImageError,
    load_adapter,
    split_qwen_key,
)

CPU = torch.device("cpu")
QWEN_PRESETS = ["qwen2.5-vl-tiny", "qwen2-vl-tiny"]


@pytest.mark.parametrize("preset", QWEN_PRESETS)
def test_checkpoint_is_a_real_hub_style_checkpoint(build_model, preset):
    directory = build_model(preset)
    model = AutoModelForImageTextToText.from_pretrained(directory)
    assert (
        type(model).__name__
        == {
            "qwen2.5-vl-tiny": "Qwen2_5_VLForConditionalGeneration",
            "qwen2-vl-tiny": "Qwen2VLForConditionalGeneration",
        }[preset]
    )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    processor_config = json.loads((directory / "processor_config.json").read_text())
    assert processor_config["processor_class"] in ("Qwen2_5_VLProcessor", "Qwen2VLProcessor")
    assert type(AutoImageProcessor.from_pretrained(directory, backend="pil")).__name__ == "Qwen2VLImageProcessorPil"


def test_auto_processor_loads_where_torchvision_is_installed(build_model):
    # transformers' Qwen2-VL processor also holds a video processor, which needs torchvision.
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(build_model("qwen2.5-vl-tiny"))
    assert processor.image_token == "<|image_pad|>"


@pytest.mark.parametrize("preset", QWEN_PRESETS)
def test_token_counts_follow_the_processor_resize_rule(build_model, preset):
    adapter = load_adapter(build_model(preset))
    assert isinstance(adapter, QwenVLAdapter) and adapter.uses_mrope
    image_processor = adapter.load_processor().image_processor
    for width, height in [(48, 40), (96, 32), (32, 80), (64, 64), (7, 300), (400, 400)]:
        processed = adapter.process_image(image_processor, make_image(1, (width, height)))
        t, h, w = processed.patch_grid
        assert processed.num_tokens == adapter.num_image_tokens(height, width) == t * h * w // 4
        assert processed.token_grid == (t, h // 2, w // 2)
        assert tuple(processed.pixel_values.shape) == (t * h * w, adapter.pixel_layout().patch_dim)
    # The aspect ratio is kept: a wide image gets a wide grid.
    wide = adapter.process_image(image_processor, make_image(2, (96, 32)))
    assert wide.token_grid[2] > wide.token_grid[1]
    with pytest.raises(UnsupportedImageError, match="aspect ratio"):
        adapter.process_image(image_processor, make_image(3, (1, 250)))


@pytest.mark.parametrize("preset", QWEN_PRESETS)
def test_halves_hold_exactly_their_weights_and_compute_what_the_whole_does(build_model, preset):
    adapter = load_adapter(build_model(preset))
    full, vision, lm = whole_and_halves(adapter, CPU)
    # One packed forward over three grids equals transformers' image features.
    _, ours, reference = encode_three_grids(adapter, vision, full, CPU)
    for got, want in zip(ours, reference.pooler_output):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=ids).logits, full(input_ids=ids).logits)


def test_qwen_key_split_covers_both_layouts():
    assert split_qwen_key("model.visual.blocks.0.attn.qkv.weight") == (Part.VISION_TOWER, "blocks.0.attn.qkv.weight")
    assert split_qwen_key("visual.merger.mlp.0.bias") == (Part.VISION_TOWER, "merger.mlp.0.bias")
    assert split_qwen_key("model.language_model.norm.weight") == (Part.LANGUAGE_MODEL, "model.norm.weight")
    assert split_qwen_key("model.layers.0.mlp.up_proj.weight") == (
        Part.LANGUAGE_MODEL,
        "model.layers.0.mlp.up_proj.weight",
    )
    assert split_qwen_key("lm_head.weight") == (Part.LANGUAGE_MODEL, "lm_head.weight")
    assert split_qwen_key("something_else.weight") is None


def _unsupported_checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "mamba"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    return directory


@pytest.mark.parametrize("command", ["pd", "encoder", "proxy"])
def test_every_service_refuses_an_unsupported_family_in_one_line(tmp_path, capsys, command):
    assert main([command, "--model", str(_unsupported_checkpoint(tmp_path))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "unsupported model_type 'mamba'" in err[0]
    assert "supported model families: llava, qwen2_5_vl, qwen2_vl, qwen3_vl, qwen3_vl_moe" in err[0]


@pytest.mark.e2e
def _free_ports_flags() -> list[str]:
    """Ports no other process holds (the port check runs before the model's), metrics off."""
    with socket.socket() as first, socket.socket() as second, socket.socket() as third:
        for sock in (first, second, third):
            sock.bind(("127.0.0.1", 0))
        proxy, encoder, pd = (sock.getsockname()[1] for sock in (first, second, third))
    return [
        "--port", str(proxy), "--encoder-base-port", str(encoder), "--pd-base-port", str(pd),
        "--proxy-metrics-port", "-1", "--encoder-metrics-base-port", "-1", "--pd-metrics-base-port", "-1",
        "--launcher-metrics-port", "-1",
    ]  # fmt: skip


def test_epd_up_refuses_an_unsupported_family_before_starting_anything(tmp_path):
    env = {**os.environ, "EPD_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--model", str(_unsupported_checkpoint(tmp_path))]
        + _free_ports_flags(),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"epd: unsupported model_type 'mamba' in {tmp_path / 'mamba'}; "
        "supported model families: llava, qwen2_5_vl, qwen2_vl, qwen3_vl, qwen3_vl_moe"
    ]
    assert "starting" not in done.stdout

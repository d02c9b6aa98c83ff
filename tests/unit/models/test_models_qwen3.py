"""Qwen3-VL and Qwen3-VL-MoE checkpoints: built in the published layout, loaded by transformers, split
into halves that compute what the whole does (DeepStack features included); Qwen3-VL's video rules."""

from __future__ import annotations

import json
import types

import pytest
import torch
from oracle_support import encode_three_grids, whole_and_halves
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as reference_smart_resize
from transformers.video_utils import VideoMetadata

from services.common.models import Qwen3VLAdapter, load_adapter
from services.common.models.qwen3_video import frame_timestamps, smart_resize
from services.common.models.vision_io import embedding_shape
from services.common.video_files import Sampling, sample_indices

CPU = torch.device("cpu")
PRESETS = ["qwen3-vl-tiny", "qwen3-vl-moe-tiny"]


@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoint_has_the_published_layout_and_loads_in_transformers(build_model, preset):
    directory = build_model(preset)
    model = AutoModelForImageTextToText.from_pretrained(directory)
    moe = preset == "qwen3-vl-moe-tiny"
    assert type(model).__name__ == ("Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration")
    with safe_open(directory / "model.safetensors", framework="pt") as handle:
        keys = list(handle.keys())
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in keys}
    assert {key.split(".")[0] + "." + key.split(".")[1] for key in keys if key.startswith("model.")} == {
        "model.language_model",
        "model.visual",
    }
    assert "lm_head.weight" in keys and any(".deepstack_merger_list.2." in key for key in keys)
    if moe:  # experts fused, [experts, in, out] as the hub's Qwen3-VL-30B-A3B has them; transformers transposes
        text = model.config.text_config
        gate_up = shapes["model.language_model.layers.0.mlp.experts.gate_up_proj"]
        down = shapes["model.language_model.layers.0.mlp.experts.down_proj"]
        assert gate_up == (text.num_experts, text.hidden_size, 2 * text.moe_intermediate_size)
        assert down == (text.num_experts, text.moe_intermediate_size, text.hidden_size)
        loaded = model.model.language_model.layers[0].mlp.experts
        with safe_open(directory / "model.safetensors", framework="pt") as handle:
            stored = handle.get_tensor("model.language_model.layers.0.mlp.experts.gate_up_proj")
        torch.testing.assert_close(loaded.gate_up_proj, stored.transpose(1, 2))
    rendered = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert (
        rendered == "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert json.loads((directory / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    video_config = json.loads((directory / "video_preprocessor_config.json").read_text())
    assert video_config["video_processor_type"] == "Qwen3VLVideoProcessor"


@pytest.mark.parametrize("preset", PRESETS)
def test_halves_hold_exactly_their_weights_and_compute_what_the_whole_does(build_model, preset):
    adapter = load_adapter(build_model(preset))
    assert isinstance(adapter, Qwen3VLAdapter) and adapter.num_deepstack_levels == 3
    full, vision, lm = whole_and_halves(adapter, CPU)
    assert lm.num_deepstack_levels == 3
    images, ours, reference = encode_three_grids(adapter, vision, full, CPU)
    for k, (got, image) in enumerate(zip(ours, images)):
        assert tuple(got.shape) == embedding_shape(image.num_tokens, adapter.hidden_size, 3)
        torch.testing.assert_close(got[:, 0], reference.pooler_output[k], rtol=1e-5, atol=1e-5)
        for level in range(3):
            torch.testing.assert_close(got[:, 1 + level], reference.deepstack_features[level][k], rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=ids).logits, full(input_ids=ids).logits)


def test_the_language_model_also_loads_experts_in_transformers_own_order(build_model, tmp_path):
    # A checkpoint re-saved by transformers holds the experts in the modules' order: it loads the same.
    source = build_model("qwen3-vl-moe-tiny")
    AutoModelForImageTextToText.from_pretrained(source).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    want = load_adapter(source).load_language_model(CPU, torch.float32)
    got = load_adapter(tmp_path).load_language_model(CPU, torch.float32)
    for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("total", "video_fps", "fps", "num_frames"),
    [
        (8, 4.0, 2.0, 0),
        (24, 4.0, 2.0, 0),
        (300, 30.0, 2.0, 0),
        (5, 25.0, 2.0, 0),
        (40, 10.0, 0.5, 0),
        (24, 4.0, 2.0, 7),
    ],
)
def test_frames_are_sampled_as_qwen3_vls_video_processor_samples_them(total, video_fps, fps, num_frames):
    processor = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768)  # sample_frames reads only these
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
    want = Qwen3VLVideoProcessor.sample_frames(
        processor, metadata, num_frames=num_frames or None, fps=None if num_frames else fps
    )
    got = sample_indices(total, video_fps, Sampling(fps=fps, num_frames=num_frames, rule="qwen3_vl"))
    assert got == want.tolist()


@pytest.mark.parametrize("frames", [2, 3, 4, 9, 60])
@pytest.mark.parametrize(("height", "width"), [(32, 48), (480, 640), (20, 1000), (1080, 1920), (7, 9)])
def test_a_clip_is_resized_as_qwen3_vls_smart_resize_resizes_it(frames, height, width):
    bounds = dict(min_pixels=32 * 32 * 32, max_pixels=32 * 32 * 1024)
    want = reference_smart_resize(frames, height, width, temporal_factor=2, factor=32, **bounds)
    assert smart_resize(frames, height, width, temporal_factor=2, factor=32, **bounds) == want


@pytest.mark.parametrize(("indices", "fps"), [([0, 2, 5, 7], 4.0), ([0, 1, 2], 2.0), ([3, 40, 77, 115, 150], 29.97)])
def test_timestamps_are_qwen3_vl_processors(indices, fps):
    assert frame_timestamps(indices, fps, 2) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)


def test_each_temporal_patch_gets_its_timestamp_between_the_vision_markers(build_model):
    adapter = load_adapter(build_model("qwen3-vl-tiny"))
    texts = adapter.video_frame_texts([0, 2, 5, 7, 9], 4.0)
    assert texts == (
        ("<0.2 seconds><|vision_start|>", "<|vision_end|>"),
        ("<1.5 seconds><|vision_start|>", "<|vision_end|>"),
        ("<2.2 seconds><|vision_start|>", "<|vision_end|>"),
    )
    assert load_adapter(build_model("qwen2.5-vl-tiny")).video_frame_texts([0, 2], 4.0) == ()

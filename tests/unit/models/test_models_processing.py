"""The torch-free half of each adapter (what the proxy loads) answers as the whole adapter does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from services.common.models import ADAPTERS, PROCESSING, load_adapter, load_processing
from services.common.models.adapter import ModelAdapter
from services.common.models.cache import ModelBuildError, default_model_dir, ensure_model_in_child, is_built
from services.common.models.served import MODEL_TYPES

PRESETS = ["tiny", "llava-siglip-tiny", "qwen2.5-vl-tiny", "qwen2-vl-tiny"]


def test_every_family_has_both_halves():
    assert ADAPTERS.keys() == PROCESSING.keys() == set(MODEL_TYPES)  # served.py decides without transformers


def test_the_start_up_check_imports_neither_transformers_nor_torch():
    code = (
        "import sys; from services.common.models.startup import refuse_unservable_model; "
        "print([m for m in ('torch', 'transformers') if m in sys.modules])"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.mark.parametrize("preset", PRESETS)
def test_processing_half_matches_the_adapter(build_model, preset):
    directory = str(build_model(preset))
    processing, adapter = load_processing(directory), load_adapter(directory)
    assert not isinstance(processing, ModelAdapter) and isinstance(adapter, type(processing))
    for name in ("family", "model_id", "image_token", "image_token_id", "eos_token_ids", "hidden_size"):
        assert getattr(processing, name) == getattr(adapter, name), name
    assert processing.max_model_len == adapter.max_model_len and processing.uses_mrope == adapter.uses_mrope
    assert processing.processor_settings() == adapter.processor_settings()
    assert processing.pixel_layout() == adapter.pixel_layout()
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    ours = processing.process_image(processing.load_processor().image_processor, image)
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.flags.c_contiguous
    assert ours.num_tokens == processing.num_image_tokens(40, 56) == adapter.num_image_tokens(40, 56)
    if ours.patch_grid is not None:
        processing.pixel_layout().check(ours.pixel_values, ours.patch_grid)  # numpy pixels pass the same check


def test_a_missing_preset_is_built_in_a_child_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    target = default_model_dir("tiny")
    assert ensure_model_in_child("") == target and is_built(target)
    assert load_processing(target).family == "llava"
    assert ensure_model_in_child("tiny") == target  # built once: no second child


def test_a_failed_child_build_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    commands = []

    def failing_run(command, check):
        commands.append(command)
        return subprocess.CompletedProcess(command, 2)

    monkeypatch.setattr(subprocess, "run", failing_run)
    with pytest.raises(ModelBuildError, match="could not be built"):
        ensure_model_in_child("bench")
    [command] = commands
    assert command[:5] == [sys.executable, "-m", "services.cli", "make-model", "--preset"]
    assert command[5:] == ["bench", "--out", str(default_model_dir("bench"))]


def test_directories_and_hub_ids_pass_through_unbuilt(tmp_path: Path):
    assert ensure_model_in_child(str(tmp_path)) == tmp_path
    assert ensure_model_in_child("llava-hf/llava-1.5-7b-hf") == "llava-hf/llava-1.5-7b-hf"

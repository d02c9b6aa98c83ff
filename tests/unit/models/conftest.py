"""Fixtures for the model tests: one tiny checkpoint built per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.models import build_checkpoint, load_adapter


@pytest.fixture(scope="session")
def models_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset, seed 0, built once; tests must not modify it."""
    return build_checkpoint("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def models_tiny_full(models_tiny_dir: Path):
    """The whole HF model (float32, CPU), the reference for the split loaders."""
    return load_adapter(models_tiny_dir).load_full_model(torch.device("cpu"), torch.float32)

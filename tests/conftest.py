"""Shared fixtures: the tiny checkpoint, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Services spawned by tests read these as their flag defaults (see
# cluster_support.TEST_PD_SETTINGS for why); tests of flag defaults clear EPD_*.
os.environ.setdefault("EPD_DTYPE", "float32")
os.environ.setdefault("EPD_KV_CACHE_MEMORY_MB", "1024")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A freshly built tiny LLaVA checkpoint (random weights, real HF format)."""
    from services.common.models import build_checkpoint

    return build_checkpoint("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def oracle(tiny_model_dir):
    """``transformers`` ``generate()`` on the full tiny checkpoint (the correctness oracle)."""
    from oracle_support import Oracle

    return Oracle(str(tiny_model_dir))

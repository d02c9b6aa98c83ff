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
def oracle(oracle_for):
    """``transformers`` ``generate()`` on the full tiny checkpoint (the correctness oracle)."""
    return oracle_for("tiny")


@pytest.fixture(scope="session")
def build_model(tmp_path_factory, request):
    """``build_model(preset)``: that preset's checkpoint (seed 0), built once per session ("tiny" is ``tiny_model_dir``)."""
    from services.common.models import build_checkpoint

    built: dict[str, Path] = {}

    def build(preset: str) -> Path:
        if preset == "tiny":
            return request.getfixturevalue("tiny_model_dir")
        if preset not in built:
            built[preset] = build_checkpoint(preset, tmp_path_factory.mktemp("models") / preset, seed=0)
        return built[preset]

    return build


@pytest.fixture(scope="session")
def oracle_for(build_model):
    """``oracle_for(preset)``: ``generate()`` on that preset's full checkpoint, loaded once per session."""
    from oracle_support import Oracle

    oracles: dict[str, Oracle] = {}

    def get(preset: str) -> Oracle:
        if preset not in oracles:
            oracles[preset] = Oracle(str(build_model(preset)))
        return oracles[preset]

    return get

"""Fixtures shared by the PD gRPC tests."""

from __future__ import annotations

import pytest

from services.common.models import load_adapter


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return load_adapter(str(tiny_model_dir))

"""The vision tower's linear layers on CPU (``LoadedVision.load(linear_backend=...)``): the packed kernel by
default, torch on request, the same embeddings within float rounding."""

from __future__ import annotations

import pytest
import torch

from services.common.cpu_kernels import load_linear
from services.common.cpu_linear import KernelLinear
from services.common.models.loaded_vision import LoadedVision


@pytest.mark.parametrize("model", ["tiny", "qwen2.5-vl-tiny"])
def test_the_tower_runs_on_the_kernel_by_default_and_encodes_as_torch_does(model):
    assert load_linear() is not None, "the test machine has a C compiler: the kernel must build"
    packed = LoadedVision.load(model, "cpu", "auto")
    plain = LoadedVision.load(model, "cpu", "auto", linear_backend="torch")
    assert any(isinstance(m, KernelLinear) for m in packed.module.modules())
    assert not any(isinstance(m, KernelLinear) for m in plain.module.modules())
    images = [(packed.sample_pixels, packed.sample_grid)] * 2
    with torch.inference_mode():
        for got, want in zip(packed.encode(images), plain.encode(images), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

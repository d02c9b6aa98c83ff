"""oneDNN matmuls for the language model's linear layers on CPU.

PyTorch runs fp32 ``nn.Linear`` on CPU through MKL's sgemm. On the bench
machine (AMD EPYC, AVX-512) oneDNN's fp32 matmul, which PyTorch ships and uses
for its compiled graphs, ran the LM's shapes 2-2.3x faster (single thread,
[64..2048, 768] x [768, 3072]: 54-93 vs 131-203 GFLOPS), with the same fp32
arithmetic (results within float rounding: max |diff| ~3e-6 relative).
Linear layers are most of a step's time, so this is the largest single lever
on CPU throughput.

The switch keeps every parameter where it is (same tensors, same names): only
the class of each ``nn.Linear`` changes, so the weights are neither copied nor
repacked. It is picked once, at construction, and only after a self-check.

oneDNN builds (and caches) a primitive per input shape, and a serving batch
has a new row count almost every step: fed raw row counts, a PD's resident
memory grew without bound (~70 MiB per 30 s under a soak of varied
requests). So the rows are padded up to a bucket (``padded_rows``: at most
7 rows or 12.5% extra, about eight buckets per doubling), which bounds the
shapes oneDNN ever sees. Each output row depends only on its input row, so
the padding rows are computed and dropped. ``epd bench linear`` measures
time and resident memory of torch, raw and bucketed oneDNN side by side.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "onednn")


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to its bucket: multiples of 8 up to 128, then of 1/16 of the power of two below."""
    step = max(8, 1 << max(0, rows.bit_length() - 4))
    return -(-rows // step) * step


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bucketed: bool = True
) -> torch.Tensor:
    """``F.linear`` through oneDNN's fp32 matmul; rows padded to ``padded_rows`` unless ``bucketed`` is False."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padded = padded_rows(rows) if bucketed else rows
    if padded != rows:
        flat = F.pad(flat, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


class OneDnnLinear(nn.Linear):
    """``nn.Linear`` whose forward is oneDNN's fp32 matmul (dense weight, no repacking), rows bucketed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def onednn_works() -> bool:
    """True when oneDNN's linear exists here and agrees with ``F.linear`` on a random input."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=generator)
    weight = torch.randn(48, 64, generator=generator)
    bias = torch.randn(48, generator=generator)
    try:
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4))


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``onednn`` for fp32 on CPU when it works, else ``torch``."""
    if backend not in BACKENDS:
        raise ValueError(f"linear backend must be one of {BACKENDS}")
    fits = device.type == "cpu" and dtype == torch.float32
    if backend == "onednn" and not fits:
        raise ValueError("the onednn linear backend is for float32 on CPU")
    if backend == "torch" or (backend == "auto" and not fits):
        return "torch"
    if onednn_works():
        return "onednn"
    if backend == "onednn":
        raise ValueError("oneDNN's linear is not available in this PyTorch build")
    return "torch"


def use_onednn_linear(model: nn.Module) -> int:
    """Switches every plain ``nn.Linear`` of ``model`` to ``OneDnnLinear`` in place; returns how many."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDnnLinear
            switched += 1
    log.info("oneDNN linear for %d layers", switched)
    return switched

"""Who runs a model's linear layers on CPU (the PD's language model, the encoder's vision tower):
the packed kernel, oneDNN or torch.

The default for float32 on CPU is ``kernel``: ``cpu_kernels/linear.c`` over
each weight packed once into its layout. A decode step reads every weight
once for a few rows, so its linears are bound by memory; measured out of
cache on the bench LM's shapes (2 threads), the kernel ran 1-48 rows 1.2-2x
faster than oneDNN and as fast from there to prefill sizes, and a whole
decode step 2x faster at one stream, 1.5x at 8, 1.2x at 32-48. The packed
copy replaces the dense weight (a tied weight stays with the module that
shares it), so memory does not grow; the module's ``weight`` is then None.
Where the kernel cannot be built, oneDNN (below), else torch.

``onednn``: PyTorch runs fp32 ``nn.Linear`` on CPU through MKL's sgemm; on
the bench machine (AMD EPYC) oneDNN's fp32 matmul, which PyTorch ships and
uses for its compiled graphs, ran the LM's shapes 2-2.3x faster (single
thread, [64..2048, 768] x [768, 3072]: 54-93 vs 131-203 GFLOPS), with the same
fp32 arithmetic (results within float rounding: max |diff| ~3e-6 relative).
This switch keeps every parameter where it is (same tensors, same names):
only the class of each ``nn.Linear`` changes, so the weights are neither
copied nor repacked. A backend is picked once, at construction, and only
after a self-check.

oneDNN builds (and caches) a primitive per input shape, and a serving batch
has a new row count almost every step: fed raw row counts, a PD's resident
memory grew without bound (~70 MiB per 30 s under a soak of varied
requests). So the rows are padded up to a bucket (``padded_rows``: at most
7 rows or 12.5% extra, about eight buckets per doubling), which bounds the
shapes oneDNN ever sees. Each output row depends only on its input row, so
the padding rows are computed and dropped (the kernel needs no buckets: it
keeps nothing per shape). ``epd bench linear`` measures time and resident
memory of torch, raw and bucketed oneDNN and the kernel side by side.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.common.cpu_kernels import LinearKernel, load_linear

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "onednn", "kernel")


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
    """``auto`` -> ``kernel`` for float32 on CPU where it builds, else ``onednn`` where it works, else ``torch``."""
    if backend not in BACKENDS:
        raise ValueError(f"linear backend must be one of {BACKENDS}")
    fits = device.type == "cpu" and dtype == torch.float32
    if backend in ("onednn", "kernel") and not fits:
        raise ValueError(f"the {backend} linear backend is for float32 on CPU")
    if backend == "torch" or (backend == "auto" and not fits):
        return "torch"
    if backend in ("auto", "kernel") and load_linear() is not None:
        return "kernel"
    if backend == "kernel":
        raise ValueError("the CPU linear kernel could not be built here (see the warning above)")
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


class KernelLinear(nn.Linear):
    """``nn.Linear`` run by the CPU linear kernel over ``packed_weight``; ``weight`` is None (packed away)."""

    kernel: LinearKernel
    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.linear(x, self.packed_weight, self.out_features, self.bias)


def use_kernel_linear(model: nn.Module, kernel: LinearKernel) -> int:
    """Packs every plain float32 ``nn.Linear`` of ``model`` for ``kernel`` in place; returns how many.

    Each dense weight is dropped once packed, except one that another module
    shares (a tied LM head: the embedding keeps it)."""
    modules = [module for module in model.modules() if type(module) is nn.Linear]
    owners: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            owners[id(parameter)] = owners.get(id(parameter), 0) + 1
    switched = 0
    with torch.no_grad():
        for module in modules:
            if module.weight.dtype != torch.float32 or module.weight.device.type != "cpu":
                continue
            module.register_buffer("packed_weight", kernel.pack(module.weight), persistent=False)
            if owners[id(module.weight)] == 1:
                module.register_parameter("weight", None)
            module.__class__ = KernelLinear
            cast(KernelLinear, module).kernel = kernel
            switched += 1
    log.info("CPU linear kernel for %d layers", switched)
    return switched


def use_linear_backend(model: nn.Module, backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolves ``backend`` (``resolve_backend``) and switches ``model``'s linear layers to it in place;
    returns the backend in use."""
    resolved = resolve_backend(backend, device, dtype)
    if resolved == "onednn":
        use_onednn_linear(model)
    elif resolved == "kernel":
        kernel = load_linear()
        assert kernel is not None  # resolve_backend picked it
        use_kernel_linear(model, kernel)
    return resolved

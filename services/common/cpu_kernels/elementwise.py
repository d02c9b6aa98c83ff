"""``elementwise.c`` loaded: RMSNorm and SiLU-and-multiply over rows of float32, one C pass each.

Built, checked and loaded like the package's other kernels (``__init__.py``).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from services.common.cpu_kernels import _I64, _PTR, KernelUnavailable, _bind, _library, _load

ELEMENTWISE_SOURCE = Path(__file__).with_name("elementwise.c")
ELEMENTWISE_ABI = 1  # epd_elementwise_abi(): bumped with its C signatures


class Elementwise:
    """``elementwise.c`` loaded: RMSNorm and SiLU-and-multiply over rows of float32."""

    def __init__(self, path: Path) -> None:
        library = _library(path, "epd_elementwise_abi", ELEMENTWISE_ABI)
        self._rms_norm = _bind(
            library, "epd_rms_norm_f32", [_PTR, _I64, _PTR, ctypes.c_float, _PTR, _I64, _I64, ctypes.c_int]
        )
        self._silu_mul = _bind(library, "epd_silu_mul_f32", [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, ctypes.c_int])

    @staticmethod
    def takes(*tensors: torch.Tensor) -> bool:
        """Whether the kernels take these tensors: float32 on the CPU, outside autograd."""
        return all(
            t.dtype == torch.float32 and t.device.type == "cpu" and not (t.requires_grad and torch.is_grad_enabled())
            for t in tensors
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x ** 2, -1) + eps))`` over the last dim, a new contiguous tensor."""
        dim = x.shape[-1]
        if not self.takes(x, weight) or weight.shape != (dim,):
            raise ValueError("elementwise kernel: tensors of another dtype, device or shape")
        rows = _rows(x)
        weight = weight.contiguous()
        out = torch.empty(x.shape, dtype=torch.float32)
        if rows.shape[0] and dim:
            self._rms_norm(
                rows.data_ptr(), rows.stride(0), weight.data_ptr(), eps, out.data_ptr(), rows.shape[0], dim,
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up``, a new contiguous tensor of their (equal) shape."""
        if not self.takes(gate, up) or gate.shape != up.shape:
            raise ValueError("elementwise kernel: tensors of another dtype, device or shape")
        gate_rows, up_rows = _rows(gate), _rows(up)
        out = torch.empty(gate.shape, dtype=torch.float32)
        if gate_rows.shape[0] and gate.shape[-1]:
            self._silu_mul(
                gate_rows.data_ptr(), gate_rows.stride(0), up_rows.data_ptr(), up_rows.stride(0), out.data_ptr(),
                gate_rows.shape[0], gate.shape[-1], torch.get_num_threads(),
            )  # fmt: skip
        return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, last dim]`` view with a contiguous last dim (a copy only where none exists)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def self_check_elementwise(kernel: Elementwise) -> None:
    """Compares both kernels with PyTorch's ops: a dim that is no multiple of eight, a strided input, a big call."""
    generator = torch.Generator().manual_seed(0)
    for rows, dim in ((3, 37), (300, 256)):
        x = torch.randn(rows, 2 * dim, generator=generator)[:, ::2] * 3  # every other column: a strided view
        weight = torch.randn(dim, generator=generator)
        want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        if not torch.allclose(kernel.rms_norm(x, weight, 1e-6), want, rtol=1e-5, atol=1e-6):
            raise KernelUnavailable("the built RMSNorm kernel disagrees with PyTorch's")
        gate, up = torch.randn(2, rows, dim, generator=generator) * 6
        want = torch.nn.functional.silu(gate) * up
        if not torch.allclose(kernel.silu_mul(gate, up), want, rtol=1e-5, atol=1e-6):
            raise KernelUnavailable("the built SiLU-and-multiply kernel disagrees with PyTorch's")


@functools.cache
def load_elementwise() -> Elementwise | None:
    """The RMSNorm and SiLU-and-multiply kernels, built if needed and self-checked; None (logged once) where
    they are unavailable."""
    return _load(
        ELEMENTWISE_SOURCE, "elementwise", Elementwise, self_check_elementwise, "norms and activations stay in PyTorch"
    )

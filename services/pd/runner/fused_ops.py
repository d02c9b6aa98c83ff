"""A decoder layer's row-wise ops in one call each: RMSNorm, and an MLP's SiLU-and-multiply.

HF's RMSNorm modules (Llama's, Qwen2's, Qwen3-VL's text model's) compute
``weight * (x * rsqrt(mean(x ** 2) + eps))`` in float32 as a chain of seven
tensor ops, and their gated MLPs ``act(gate) * up`` as two; each op pays
Python and dispatch overhead and a pass over memory. A decode step of the
bench LM runs 25 norms and 12 MLPs: at 32 rows on two cores the norms took
5-6 ms of a 130 ms step.

- On the CPU in float32, where ``cpu_kernels`` built, both run as one C pass
  (``elementwise.c``): within a few ulps of PyTorch's ops, not bit for bit
  (its mean sums in eight lanes), like the linear and attention kernels the
  same step runs; the greedy oracle tests hold it to ``generate()``'s tokens.
- Elsewhere a norm whose class a probe finds bit-identical to ``F.rms_norm``
  (float32 on the CPU it is; another dtype or another formula, such as
  Gemma's ``1 + weight``, keeps HF's forward) runs as that one ATen call, and
  the MLP keeps HF's forward.

A class is switched only where a probe on random inputs agrees with its own
forward: a norm or MLP of another formula keeps it. Inputs the kernels do not
take (another dtype or device, autograd) fall back to the module's own path
per call.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.common.cpu_kernels import Elementwise, load_elementwise

log = logging.getLogger(__name__)

_PROBE_RTOL, _PROBE_ATOL = 1e-5, 1e-6  # the kernels' error, with room: a few ulps


class _FusedRMSNorm(nn.Module):
    """Mixin put in front of an HF RMSNorm class: its forward is ``F.rms_norm``."""

    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


class _KernelRMSNorm(_FusedRMSNorm):
    """Mixin put in front of an HF RMSNorm class: the C kernel, ``F.rms_norm`` for what it does not take."""

    kernel: Elementwise

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.kernel.takes(hidden_states, self.weight):
            return self.kernel.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


class _KernelSiluMLP(nn.Module):
    """Mixin put in front of an HF gated-MLP class: ``down(silu(gate(x)) * up(x))`` with the product in C."""

    kernel: Elementwise
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.kernel.takes(gate, up):
            return self.down_proj(self.kernel.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")
    )


def _probe_input(module: nn.Module, features: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    parameter = next(module.parameters())
    return (torch.randn(5, features, generator=generator) * 3).to(parameter.device, parameter.dtype)


def _f_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _norm_agrees(
    module: nn.Module, candidate: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], exact: bool
) -> bool:
    """``candidate(x, weight, eps)`` gives the output of a copy of ``module`` with a random weight (a model's
    may be all ones or zeros), on a random input of its dtype and device: bit for bit where ``exact``, else
    within a few ulps."""
    probe = copy.deepcopy(module)
    weight, eps = probe.weight, probe.variance_epsilon
    assert isinstance(weight, torch.Tensor) and isinstance(eps, float)  # _is_rms_norm checked both
    with torch.inference_mode():
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
        x = _probe_input(probe, weight.shape[0])
        want, got = probe(x), candidate(x, weight, eps)
    if want.dtype != got.dtype:
        return False
    return torch.equal(want, got) if exact else torch.allclose(want, got, rtol=_PROBE_RTOL, atol=_PROBE_ATOL)


def _mlp_agrees(module: nn.Module, kernel: Elementwise) -> bool:
    """The module's forward is ``down(silu(gate(x)) * up(x))`` (its activation SiLU), on a random input."""
    gate, up, down = (cast(nn.Module, getattr(module, name)) for name in ("gate_proj", "up_proj", "down_proj"))
    in_features = getattr(gate, "in_features", None)
    if not isinstance(in_features, int):
        return False
    with torch.inference_mode():
        x = _probe_input(module, in_features)
        want, gated = module(x), gate(x)
        if not kernel.takes(want, gated):
            return False
        got = down(kernel.silu_mul(gated, up(x)))
    return torch.allclose(want, got, rtol=_PROBE_RTOL, atol=_PROBE_ATOL)


def _switch(
    model: nn.Module, wants: Callable[[nn.Module], bool], verdict: Callable[[nn.Module], type | None]
) -> tuple[int, list[str]]:
    """Switches each module ``wants`` picks to the class ``verdict`` gives for its class (asked once per class;
    None: kept). Returns how many were switched, and the names of the classes kept."""
    verdicts: dict[type, type | None] = {}
    switched = 0
    for module in model.modules():
        cls = type(module)
        if isinstance(module, (_FusedRMSNorm, _KernelSiluMLP)) or not wants(module):
            continue  # switched already (a model given to a second runner), or not one of these
        if cls not in verdicts:
            verdicts[cls] = verdict(module)
        fused = verdicts[cls]
        if fused is not None:
            module.__class__ = fused
            switched += 1
    return switched, sorted(cls.__name__ for cls, fused in verdicts.items() if fused is None)


def use_fused_rms_norm(model: nn.Module, *, cpu_kernel: bool = True) -> int:
    """Switches every RMSNorm module of ``model`` that agrees with a faster path to it, in place: the C kernel
    (float32 on the CPU, within a few ulps; not with ``cpu_kernel`` False), else ``F.rms_norm`` (bit for bit).
    Returns how many (idempotent: 0 the second time)."""
    kernel = load_elementwise() if cpu_kernel else None

    def verdict(module: nn.Module) -> type | None:
        cls = type(module)
        weight = module.weight
        assert isinstance(weight, torch.Tensor)  # _is_rms_norm checked it
        if kernel is not None and kernel.takes(weight.detach()) and _norm_agrees(module, kernel.rms_norm, exact=False):
            return type(f"Kernel{cls.__name__}", (_KernelRMSNorm, cls), {"kernel": kernel})
        if _norm_agrees(module, _f_rms_norm, exact=True):
            return type(f"Fused{cls.__name__}", (_FusedRMSNorm, cls), {})
        return None

    switched, kept = _switch(model, _is_rms_norm, verdict)
    log.info("faster RMSNorm for %d norms%s", switched, f"; HF's forward kept for {', '.join(kept)}" if kept else "")
    return switched


def use_fused_silu_mlp(model: nn.Module) -> int:
    """Switches every gated SiLU MLP of ``model`` on float32 CPU weights to the C SiLU-and-multiply, in place,
    where the kernel built and a probe agrees with the module's forward; returns how many (idempotent)."""
    kernel = load_elementwise()
    if kernel is None:
        return 0

    def wants(module: nn.Module) -> bool:
        parameter = next(module.parameters(), None) if _is_gated_mlp(module) else None
        return parameter is not None and kernel.takes(parameter.detach())

    def verdict(module: nn.Module) -> type | None:
        cls = type(module)
        return (
            type(f"Kernel{cls.__name__}", (_KernelSiluMLP, cls), {"kernel": kernel})
            if _mlp_agrees(module, kernel)
            else None
        )

    switched, kept = _switch(model, wants, verdict)
    log.info(
        "SiLU-and-multiply kernel for %d MLPs%s", switched, f"; HF's forward kept for {', '.join(kept)}" if kept else ""
    )
    return switched

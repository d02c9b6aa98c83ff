"""RMSNorm through ``F.rms_norm``: one ATen call where HF's module makes seven.

HF's RMSNorm modules (Llama's, Qwen2's, Qwen3-VL's text model's) compute
``weight * (x * rsqrt(mean(x ** 2) + eps))`` in float32 as a chain of
tensor ops, each paying Python and dispatch overhead; a decode step of the
bench LM runs 25 of them. ``F.rms_norm`` computes the same chain in one
call. A class is switched only where a probe finds the two bit-identical
(float32 on the CPU: they are; another dtype or another formula, such as
Gemma's ``1 + weight``, keeps HF's forward), so the switch cannot change
an output.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class _FusedRMSNorm(nn.Module):
    """Mixin class put in front of an HF RMSNorm class: its forward is ``F.rms_norm``."""

    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _agrees(module: nn.Module) -> bool:
    """``F.rms_norm`` gives exactly the output of a copy of ``module`` with a random weight, on a random
    input of its dtype and device (a random weight, since a model's may be all ones or zeros)."""
    probe = copy.deepcopy(module)
    weight = probe.weight
    assert isinstance(weight, torch.Tensor)  # _is_rms_norm checked it
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        weight.copy_(torch.randn(weight.shape, generator=generator))
        x = (torch.randn(5, weight.shape[0], generator=generator) * 3).to(weight.device, weight.dtype)
        want = probe(x)
        got = F.rms_norm(x, weight.shape, weight, probe.variance_epsilon)  # type: ignore[arg-type]
    return want.dtype == got.dtype and torch.equal(want, got)


def use_fused_rms_norm(model: nn.Module) -> int:
    """Switches every RMSNorm module of ``model`` whose class agrees with ``F.rms_norm`` (bit for bit,
    probed once per class) to it, in place; returns how many (idempotent: 0 the second time)."""
    verdicts: dict[type, type | None] = {}
    switched = 0
    for module in model.modules():
        cls = type(module)
        if isinstance(module, _FusedRMSNorm) or not _is_rms_norm(module):
            continue  # switched already (a model given to a second runner), or no RMSNorm
        if cls not in verdicts:
            verdicts[cls] = type(f"Fused{cls.__name__}", (_FusedRMSNorm, cls), {}) if _agrees(module) else None
        fused = verdicts[cls]
        if fused is not None:
            module.__class__ = fused
            switched += 1
    kept = sorted(cls.__name__ for cls, fused in verdicts.items() if fused is None)
    log.info("F.rms_norm for %d norms%s", switched, f"; HF's forward kept for {', '.join(kept)}" if kept else "")
    return switched

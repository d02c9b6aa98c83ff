"""Resolution of ``--device`` and ``--dtype``: nothing else picks a device."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` means CUDA when present, else CPU; anything else is passed to torch."""
    if name in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` means float32 on CPU and bfloat16 on CUDA."""
    if name in ("", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def exact_float32(device: torch.device, dtype: torch.dtype) -> None:
    """float32 on CUDA means IEEE float32: TF32 off for matmuls and convolutions.

    TF32 keeps 10 mantissa bits; outputs compared token for token with a
    float32 reference (the test oracle) must not depend on it. Process-wide,
    and only touched when this process runs float32 on CUDA.
    """
    if device.type == "cuda" and dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

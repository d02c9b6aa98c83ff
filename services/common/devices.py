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

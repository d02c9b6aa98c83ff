"""The tensor wire codec: dtype enum + shape + raw little-endian bytes.

This is the only module that turns torch tensors into bytes and back
(``wire.py`` encodes the proxy's numpy arrays in the same format). It never
uses pickle or ``torch.load``: a payload is validated against its declared
dtype and shape before a single byte is interpreted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from services.common.pb import epd_pb2
from services.common.wire import CHUNK_BYTES, MAX_ID_CHARS, iter_chunks

__all__ = [
    "CHUNK_BYTES",
    "MAX_ID_CHARS",
    "PIXEL_DTYPES",
    "all_finite",
    "dtype_from_pb",
    "dtype_to_pb",
    "expected_num_bytes",
    "from_pb",
    "iter_chunks",
    "tensor_bytes",
    "tensor_from_bytes",
    "to_pb",
]

_TO_PB: dict[torch.dtype, epd_pb2.DType] = {
    torch.float32: epd_pb2.DTYPE_FLOAT32,
    torch.float16: epd_pb2.DTYPE_FLOAT16,
    torch.bfloat16: epd_pb2.DTYPE_BFLOAT16,
    torch.uint8: epd_pb2.DTYPE_UINT8,
}
_FROM_PB: dict[int, torch.dtype] = {v: k for k, v in _TO_PB.items()}


PIXEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes accepted for the pixel tensors of an Encode call (encoder service and colocated PD)."""


def dtype_to_pb(dtype: torch.dtype) -> epd_pb2.DType:
    """Maps a torch dtype to its ``epd.v1.DType`` value (ValueError if unsupported)."""
    try:
        return _TO_PB[dtype]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {dtype}") from None


def dtype_from_pb(value: int) -> torch.dtype:
    """Maps an ``epd.v1.DType`` value to a torch dtype (ValueError if unknown)."""
    try:
        return _FROM_PB[value]
    except KeyError:
        raise ValueError(f"unsupported wire dtype {value}") from None


def expected_num_bytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Byte size of a C-contiguous tensor of ``dtype`` and ``shape``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw bytes of ``tensor`` (moved to CPU and made contiguous), without a copy when possible."""
    cpu = tensor.detach().to("cpu").contiguous()
    # numpy has no bfloat16: view the storage as bytes instead.
    return cpu.view(torch.uint8).numpy().data.cast("B") if cpu.numel() else memoryview(b"")


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Builds a tensor from raw bytes after checking the byte count matches ``shape``."""
    if any(int(d) < 0 for d in shape):
        raise ValueError("tensor shape has a negative dimension")
    shape = tuple(int(d) for d in shape)
    want = expected_num_bytes(dtype, shape)
    if len(data) != want:
        raise ValueError(f"tensor payload is {len(data)} bytes, expected {want} for shape {list(shape)}")
    if want == 0:
        return torch.empty(shape, dtype=dtype)
    # The tensor must own writable memory: a bytearray is used as is (the
    # caller hands it over), anything else (a read-only gRPC buffer) is copied.
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no element of ``tensor`` is NaN or infinite (non-float tensors always are finite).

    The same answer as ``torch.isfinite(tensor).all()``, in one read of the tensor and without its
    boolean temporary (about 30 times faster on a received KV push): a NaN anywhere makes both the
    minimum and the maximum NaN, and an infinity is the maximum or the minimum."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def to_pb(tensor: torch.Tensor) -> epd_pb2.Tensor:
    """Encodes a tensor as an ``epd.v1.Tensor`` message."""
    return epd_pb2.Tensor(
        dtype=dtype_to_pb(tensor.dtype),
        shape=list(tensor.shape),
        data=bytes(tensor_bytes(tensor)),
    )


def from_pb(message: epd_pb2.Tensor) -> torch.Tensor:
    """Decodes an ``epd.v1.Tensor`` message; ValueError on any inconsistency."""
    return tensor_from_bytes(message.data, dtype_from_pb(message.dtype), list(message.shape))

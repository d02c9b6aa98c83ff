"""The tensor wire codec: dtype enum + shape + raw little-endian bytes.

This is the only module that turns tensors into bytes and back. It never
uses pickle or ``torch.load``: a payload is validated against its declared
dtype and shape before a single byte is interpreted.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence

import torch

from services.common.pb import epd_pb2

CHUNK_BYTES = 1 << 20
"""Largest raw chunk of a streamed tensor (1 MiB), far below gRPC's limits."""

_TO_PB = {
    torch.float32: epd_pb2.DTYPE_FLOAT32,
    torch.float16: epd_pb2.DTYPE_FLOAT16,
    torch.bfloat16: epd_pb2.DTYPE_BFLOAT16,
    torch.uint8: epd_pb2.DTYPE_UINT8,
}
_FROM_PB = {v: k for k, v in _TO_PB.items()}

# Every supported platform is little-endian; the wire format is defined as
# little-endian so a big-endian host must refuse rather than misread.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("the tensor wire codec requires a little-endian host")


PIXEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes accepted for the pixel tensors of an Encode call (encoder service and colocated PD)."""

MAX_ID_CHARS = 256
"""Longest request id, mm_hash or reservation id accepted in an Encode call (they end up in logs and metadata)."""


def dtype_to_pb(dtype: torch.dtype) -> int:
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
    return memoryview(cpu.view(torch.uint8).numpy()).cast("B") if cpu.numel() else memoryview(b"")


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


def iter_chunks(data: memoryview | bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Splits a payload into chunks of at most ``chunk_bytes``."""
    view = memoryview(data)
    for start in range(0, len(view), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])

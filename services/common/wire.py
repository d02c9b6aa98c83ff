"""The tensor wire format without torch: numpy arrays into ``epd.v1.Tensor`` (dtype enum + shape + raw bytes).

The proxy sends its pixels with ``array_to_pb``; ``tensors.py`` is the torch
codec of the same format (encoder, PD) and shares this module's constants.
A payload is raw little-endian bytes in C order: never pickle.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np

from services.common.pb import epd_pb2

CHUNK_BYTES = 1 << 20
"""Largest raw chunk of a streamed tensor (1 MiB), far below gRPC's limits."""

MAX_ID_CHARS = 256
"""Longest request id, mm_hash or reservation id accepted in an Encode call (they end up in logs and metadata)."""

# Every supported platform is little-endian; the wire format is defined as
# little-endian so a big-endian host must refuse rather than misread.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("the tensor wire codec requires a little-endian host")

# numpy has no bfloat16: bfloat16 tensors only travel through the torch codec.
# Keys are native-order dtypes, so a byte-swapped array is refused, not misread.
_NUMPY_TO_PB = {
    np.dtype(np.float32): epd_pb2.DTYPE_FLOAT32,
    np.dtype(np.float16): epd_pb2.DTYPE_FLOAT16,
    np.dtype(np.uint8): epd_pb2.DTYPE_UINT8,
}


def array_dtype_to_pb(dtype: np.dtype) -> epd_pb2.DType:
    """Maps a numpy dtype to its ``epd.v1.DType`` value (ValueError if unsupported)."""
    try:
        return _NUMPY_TO_PB[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"unsupported array dtype {dtype}") from None


def array_to_pb(array: np.ndarray) -> epd_pb2.Tensor:
    """Encodes a numpy array as an ``epd.v1.Tensor`` message: the bytes ``tensors.to_pb`` sends for the same values."""
    return epd_pb2.Tensor(
        dtype=array_dtype_to_pb(array.dtype),
        shape=[int(d) for d in array.shape],
        data=np.ascontiguousarray(array).tobytes(),
    )


def iter_chunks(data: memoryview | bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Splits a payload into chunks of at most ``chunk_bytes``."""
    view = memoryview(data)
    for start in range(0, len(view), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])

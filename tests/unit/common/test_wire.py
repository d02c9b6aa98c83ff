"""The numpy wire encoder (the proxy's) writes exactly the messages the torch codec writes."""

import numpy as np
import pytest
import torch

from services.common import tensors, wire
from services.common.pb import epd_pb2


@pytest.mark.parametrize(
    ("np_dtype", "torch_dtype"), [(np.float32, torch.float32), (np.float16, torch.float16), (np.uint8, torch.uint8)]
)
def test_numpy_and_torch_codecs_write_the_same_message(np_dtype, torch_dtype):
    array = (np.random.default_rng(0).standard_normal((3, 7, 5)) * 100).astype(np_dtype)
    ours = wire.array_to_pb(array)
    theirs = tensors.to_pb(torch.from_numpy(array))
    assert ours.SerializeToString() == theirs.SerializeToString()
    assert ours.dtype == tensors.dtype_to_pb(torch_dtype)
    decoded = tensors.from_pb(ours)
    assert decoded.dtype == torch_dtype and torch.equal(decoded, torch.from_numpy(array))


def test_non_contiguous_array_is_sent_in_logical_order():
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    assert not array.flags.c_contiguous
    message = wire.array_to_pb(array)
    assert list(message.shape) == [4, 3]
    assert torch.equal(tensors.from_pb(message), torch.from_numpy(np.ascontiguousarray(array)))


def test_empty_array_round_trips():
    message = wire.array_to_pb(np.empty((0, 4), dtype=np.float32))
    assert message.data == b"" and tensors.from_pb(message).shape == (0, 4)


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.dtype(">f4")])
def test_dtypes_off_the_wire_are_refused(dtype):
    # float64 and int64 have no wire dtype; a byte-swapped float32 would be misread as little-endian.
    with pytest.raises(ValueError, match="unsupported array dtype"):
        wire.array_to_pb(np.zeros(2, dtype=dtype))


def test_codecs_share_constants():
    assert tensors.CHUNK_BYTES == wire.CHUNK_BYTES and tensors.MAX_ID_CHARS == wire.MAX_ID_CHARS
    assert tensors.iter_chunks is wire.iter_chunks
    assert wire.array_dtype_to_pb(np.dtype(np.float32)) == epd_pb2.DTYPE_FLOAT32

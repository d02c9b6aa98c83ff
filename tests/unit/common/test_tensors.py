"""The tensor wire codec round-trips every dtype and rejects inconsistent payloads."""

import pytest
import torch

from services.common import tensors
from services.common.pb import epd_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_round_trip_preserves_bits(dtype):
    original = (torch.randn(7, 5) * 100).to(dtype)
    decoded = tensors.from_pb(tensors.to_pb(original))
    assert decoded.dtype == dtype and decoded.shape == original.shape
    assert torch.equal(decoded.view(torch.uint8), original.view(torch.uint8))


def test_non_contiguous_tensor_is_sent_in_logical_order():
    original = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(tensors.from_pb(tensors.to_pb(original)), original)


def test_empty_tensor_round_trips():
    decoded = tensors.from_pb(tensors.to_pb(torch.empty(0, 4)))
    assert decoded.shape == (0, 4)


def test_byte_count_mismatch_is_rejected():
    message = tensors.to_pb(torch.zeros(2, 3))
    message.data = message.data[:-1]
    with pytest.raises(ValueError, match="expected 24"):
        tensors.from_pb(message)


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="unsupported wire dtype"):
        tensors.from_pb(epd_pb2.Tensor(dtype=99, shape=[1], data=b"\0" * 4))
    with pytest.raises(ValueError, match="unsupported tensor dtype"):
        tensors.to_pb(torch.zeros(2, dtype=torch.int64))


def test_decoded_tensor_owns_writable_memory():
    message = tensors.to_pb(torch.ones(4))
    decoded = tensors.from_pb(message)
    decoded += 1  # would fail on a read-only buffer
    assert decoded.tolist() == [2.0] * 4


def test_chunks_are_bounded_and_reassemble():
    payload = bytes(range(256)) * 9000  # ~2.2 MiB
    chunks = list(tensors.iter_chunks(payload))
    assert all(len(c) <= tensors.CHUNK_BYTES for c in chunks)
    assert len(chunks) == 3 and b"".join(chunks) == payload


def test_bfloat16_bytes_without_numpy_support():
    original = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    raw = bytes(tensors.tensor_bytes(original))
    assert len(raw) == 4
    assert torch.equal(tensors.tensor_from_bytes(raw, torch.bfloat16, [2]), original)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_finds_any_non_finite_value_as_isfinite_does(dtype, bad):
    small = torch.randn(67).to(dtype)
    assert tensors.all_finite(small) and tensors.all_finite(small.reshape(67, 1)[::2])
    for position in range(small.numel()):  # every lane and tail position of the vectorized reduction
        spoiled = small.clone()
        spoiled[position] = bad
        assert not tensors.all_finite(spoiled) and not bool(torch.isfinite(spoiled).all())
    large = torch.randn(2, 3, 4, 257, 4, 16).to(dtype)
    assert tensors.all_finite(large)
    for position in (0, 1, 4095, large.numel() // 2 + 3, large.numel() - 1):
        spoiled = large.clone()
        spoiled.view(-1)[position] = bad
        assert not tensors.all_finite(spoiled)
    assert not tensors.all_finite(torch.full((5,), bad, dtype=dtype))


def test_all_finite_finds_nans_of_any_bit_pattern():
    values = torch.zeros(40, dtype=torch.float32)
    for bits in (0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFFFFFFF):  # quiet, negative, signalling, all ones
        spoiled = values.clone()
        spoiled.view(torch.int32)[17] = torch.tensor(bits, dtype=torch.int64).to(torch.int32)
        assert torch.isnan(spoiled[17]) and not tensors.all_finite(spoiled)


def test_all_finite_passes_empty_and_integer_tensors():
    assert tensors.all_finite(torch.empty(0, 4)) and tensors.all_finite(torch.arange(5, dtype=torch.uint8))
    assert tensors.all_finite(torch.tensor([torch.finfo(torch.float16).max, -65504.0], dtype=torch.float16))

"""A decode PD receives KV pushes with the embedding push's protections, and bounds one caller's reservations.

One in-process ``--role decode`` PD on the tiny model with small bounds; a raw
gRPC client plays the proxy (ReserveKV) and the prefill PD (PushKV, zero KV of
the right shape). Checked: a second stream on a reservation is refused before
any buffer, pushes in flight are bounded per caller and their buffers in
bytes, a stream that trickles empty chunks is ended at its idle timeout, and
one caller's reservations hold at most their share of the decode slots. After
every test nothing is left reserved, pending, referenced or buffered.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from pd_client import new_request_id, single_pd

from services.common import tensors
from services.common.grpc_utils import RETRY_AFTER_KEY
from services.common.pb import epd_pb2

IDLE_S = 1.0
MAX_SEQS = 8  # a caller's reservations: half of them


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dir):
    yield from single_pd(
        tiny_model_dir,
        role="decode",
        push_idle_timeout_s=IDLE_S,
        max_pushes_per_peer=2,
        max_kv_push_buffer_mb=1,
        max_num_seqs=MAX_SEQS,
    )


@pytest.fixture
def kv(pd_cluster):
    return pd_cluster.pds[0].servicer.kv


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def reserve(stub, num_tokens: int) -> tuple[str, epd_pb2.ReserveKVResponse]:
    request_id = new_request_id()
    prompt = [3 + i % 50 for i in range(num_tokens)]
    return request_id, stub.ReserveKV(epd_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt))


def push_chunks(kv, request_id, grant, *, release: threading.Event | None = None, trickle_s: float = 0.0):
    """A PushKV stream of zero K/V for ``grant``'s blocks; with ``release``, it stops after the header
    until set; with ``trickle_s``, it sends empty chunks every ``trickle_s`` seconds (for 10 s) instead."""
    shape = list(kv.engine.core.runner.kv_push_shape(grant.num_blocks - grant.num_cached_blocks))
    payload = bytes(tensors.expected_num_bytes(torch.float32, shape))
    yield epd_pb2.PushKVChunk(
        header=epd_pb2.KVHeader(
            request_id=request_id,
            reservation_id=grant.reservation_id,
            dtype=tensors.dtype_to_pb(torch.float32),
            shape=shape,
            num_bytes=len(payload),
            first_token_id=1,
        )
    )
    if release is not None:
        release.wait(10)
    if trickle_s:
        for _ in range(int(10 / trickle_s)):
            time.sleep(trickle_s)
            yield epd_pb2.PushKVChunk(data=b"")
    for chunk in tensors.iter_chunks(payload):
        yield epd_pb2.PushKVChunk(data=chunk)


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def abort(stub, *request_ids: str) -> None:
    for request_id in request_ids:
        stub.Abort(epd_pb2.AbortRequest(request_id=request_id))


def test_a_second_stream_on_a_reservation_in_flight_is_refused_before_any_buffer(stub, kv):
    request_id, grant = reserve(stub, 40)
    release = threading.Event()
    first = stub.PushKV.future(push_chunks(kv, request_id, grant, release=release), timeout=30)
    wait_for(lambda: kv.slots.buffered_bytes > 0)
    one_buffer = kv.slots.buffered_bytes
    for _ in range(20):  # each would otherwise take a buffer of the reservation's full size
        assert code_of(lambda: stub.PushKV(push_chunks(kv, request_id, grant), timeout=30)) == (
            grpc.StatusCode.FAILED_PRECONDITION
        )
    assert kv.slots.buffered_bytes == one_buffer and kv.slots.num_in_flight == 1
    release.set()
    assert first.result(timeout=30).num_bytes == one_buffer  # the first push still lands
    abort(stub, request_id)


def test_kv_pushes_in_flight_are_bounded_per_caller(stub, kv):
    reserved = [reserve(stub, 20) for _ in range(3)]
    release = threading.Event()
    held = [stub.PushKV.future(push_chunks(kv, r, g, release=release), timeout=30) for r, g in reserved[:2]]
    wait_for(lambda: kv.slots.num_in_flight == 2)
    with pytest.raises(grpc.RpcError) as refused:
        stub.PushKV(push_chunks(kv, *reserved[2]), timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(refused.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
    release.set()
    for future in held:
        assert future.result(timeout=30).num_bytes > 0
    assert stub.PushKV(push_chunks(kv, *reserved[2]), timeout=30).num_bytes > 0  # its reservation stayed open
    abort(stub, *(r for r, _ in reserved))


def test_kv_push_buffers_are_bounded_in_bytes(stub, kv):
    (first_id, first), (second_id, second) = reserve(stub, 1200), reserve(stub, 1200)  # 600 KiB each; 1 MiB
    release = threading.Event()
    held = stub.PushKV.future(push_chunks(kv, first_id, first, release=release), timeout=30)
    wait_for(lambda: kv.slots.buffered_bytes > 0)
    assert code_of(lambda: stub.PushKV(push_chunks(kv, second_id, second), timeout=30)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    release.set()
    assert held.result(timeout=30).num_bytes > 0
    assert stub.PushKV(push_chunks(kv, second_id, second), timeout=30).num_bytes > 0  # room again
    abort(stub, first_id, second_id)


def test_a_kv_push_trickling_empty_chunks_is_ended_at_its_idle_timeout(stub, kv, pd_cluster):
    request_id, grant = reserve(stub, 40)
    started = time.monotonic()
    trickle = push_chunks(kv, request_id, grant, trickle_s=0.1)  # 10 s of empty chunks
    assert code_of(lambda: stub.PushKV(trickle, timeout=30)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 8 * IDLE_S  # well before the trickle would end
    wait_for(lambda: kv.slots.num_in_flight == 0)
    assert stub.PushKV(push_chunks(kv, request_id, grant), timeout=30).num_bytes > 0  # still wanted
    abort(stub, request_id)


def test_one_caller_holds_at_most_its_share_of_the_decode_slots(stub):
    held = [reserve(stub, 10)[0] for _ in range(MAX_SEQS // 2)]
    with pytest.raises(grpc.RpcError) as refused:
        reserve(stub, 10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(refused.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
    abort(stub, held[0])  # an abort gives the room back
    held[0] = reserve(stub, 10)[0]
    abort(stub, *held)

"""PD over real gRPC: READY from the KV prefix cache, the waiting-queue bound, the readiness watchdog.

One PD with one running slot (``max_num_seqs=1``) so that queueing is easy to
arrange, a small embedding cache so that an image is easy to evict, and a
short stall timeout so that a frozen step loop shows quickly. After every
test nothing is left reserved, pending, pinned or referenced.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import grpc
import pytest
import torch
from cluster_support import InProcessCluster
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pd_client import greedy, new_request_id, push_chunks, run_generate

from services.common.grpc_utils import RETRY_AFTER_KEY
from services.common.pb import epd_pb2, epd_pb2_grpc

MAX_WAITING_TOKENS = 48
STALL_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    overrides = {
        "embedding_cache_tokens": 64,
        "max_num_seqs": 1,
        "max_waiting_tokens": MAX_WAITING_TOKENS,
        "waiting_retry_after_ms": 250,
        "stall_timeout_s": STALL_TIMEOUT_S,
    }
    cluster = InProcessCluster(str(tiny_model_dir), num_encoders=0, with_proxy=False, pd=overrides).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def stub(cluster):
    with grpc.insecure_channel(cluster.pd_addresses[0]) as channel:
        yield epd_pb2_grpc.PrefillDecodeStub(channel)
    assert cluster.leaks() == {}, "PD left something reserved, pending, pinned or referenced"
    assert cluster.run(cluster.pds[0].stats()).num_kv_blocks_pinned == 0


def _request(request_id, prompt, items=(), max_tokens=8, **sampling) -> epd_pb2.GenerateRequest:
    return epd_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, mm_items=list(items), sampling=greedy(max_tokens, **sampling)
    )


def _generate(stub, request: epd_pb2.GenerateRequest):
    token_ids, _, final = run_generate(stub, request)
    return token_ids, final


def _preallocate(stub, request_id, prompt, items) -> epd_pb2.PreallocateResponse:
    return stub.Preallocate(epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items))


def _wait_for(predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- READY from the KV prefix cache --------------------------------------------


def test_preallocate_answers_ready_from_cached_kv_after_the_embedding_is_gone(stub, adapter):
    mm_hash = uuid.uuid4().hex * 2
    # 3 text tokens, 16 image rows, 20 text tokens: blocks 0-1 (32 tokens) cover the image.
    prompt = [5, 6, 7] + [adapter.image_token_id] * 16 + list(range(20, 40))
    items = [epd_pb2.MultiModalItem(mm_hash=mm_hash, offset=3, num_tokens=16)]
    first = new_request_id()
    [reserved] = _preallocate(stub, first, prompt, items).items
    assert reserved.state == epd_pb2.ItemAllocation.RESERVED
    stub.PushEmbedding(push_chunks(first, reserved.reservation_id, mm_hash, torch.randn(16, adapter.hidden_size)))
    expected, final = _generate(stub, _request(first, prompt, items))
    assert final.usage.cached_tokens == 0
    # Another image fills the 64-row embedding cache: the first one is evicted.
    filler = new_request_id()
    big = [epd_pb2.MultiModalItem(mm_hash=uuid.uuid4().hex * 2, offset=0, num_tokens=60)]
    _preallocate(stub, filler, [adapter.image_token_id] * 60 + [1], big)
    stub.Abort(epd_pb2.AbortRequest(request_id=filler))

    repeat = new_request_id()
    [ready] = _preallocate(stub, repeat, prompt, items).items
    assert ready.state == epd_pb2.ItemAllocation.READY
    with pytest.raises(grpc.RpcError) as info:  # a KV pin is never a push target
        stub.PushEmbedding(push_chunks(repeat, ready.reservation_id, mm_hash, torch.randn(16, adapter.hidden_size)))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    token_ids, final = _generate(stub, _request(repeat, prompt, items))
    assert token_ids == expected
    assert final.usage.cached_tokens == 32 and final.usage.image_tokens == 16


def test_a_kv_pin_is_released_by_abort_before_generate(stub, adapter, cluster):
    prompt = [5, 6, 7] + [adapter.image_token_id] * 16 + list(range(40, 60))
    items = [epd_pb2.MultiModalItem(mm_hash=uuid.uuid4().hex * 2, offset=3, num_tokens=16)]
    first = new_request_id()
    [reserved] = _preallocate(stub, first, prompt, items).items
    stub.PushEmbedding(
        push_chunks(first, reserved.reservation_id, items[0].mm_hash, torch.randn(16, adapter.hidden_size))
    )
    _generate(stub, _request(first, prompt, items, max_tokens=1))
    repeat = new_request_id()
    [ready] = _preallocate(stub, repeat, prompt, items).items
    assert ready.state == epd_pb2.ItemAllocation.READY
    assert cluster.run(cluster.pds[0].stats()).num_kv_blocks_pinned == 2
    stub.Abort(epd_pb2.AbortRequest(request_id=repeat))  # the stub fixture checks the pin is gone


# -- the waiting-queue bound ---------------------------------------------------


def test_waiting_token_bound_answers_resource_exhausted_with_retry_after(stub, cluster):
    running = stub.Generate(_request(new_request_id(), [1, 2, 3], max_tokens=1000, ignore_eos=True), timeout=60)
    next(running)  # holds the only running slot
    queued = stub.Generate(_request(new_request_id(), list(range(1, 31)), ignore_eos=True), timeout=60)  # 30 wait
    _wait_for(lambda: cluster.run(cluster.pds[0].stats()).num_waiting == 1, what="a queued request")
    with pytest.raises(grpc.RpcError) as info:  # 30 + 20 > 48 waiting tokens
        list(stub.Generate(_request(new_request_id(), list(range(1, 21))), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(info.value.trailing_metadata())[RETRY_AFTER_KEY]) == 250
    with pytest.raises(grpc.RpcError) as info:  # could never wait here, even alone
        list(stub.Generate(_request(new_request_id(), list(range(1, MAX_WAITING_TOKENS + 2))), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    running.cancel()
    assert len([t for m in queued for t in m.token_ids]) == 8  # the queued one runs to the end


# -- the readiness watchdog ----------------------------------------------------


def _ready_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="epd.v1.PrefillDecode"), timeout=5
        )
    return reply.status


def test_frozen_step_loop_reports_not_serving_then_recovers(stub, cluster):
    """Freezes the engine thread with an ordinary engine command that blocks on an
    Event (``Engine.call`` runs any callable between steps): no test-only hook needed."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    address = cluster.pd_addresses[0]
    _wait_for(lambda: _ready_status(address) == serving, what="SERVING")
    stream = stub.Generate(_request(new_request_id(), [1, 2, 3], max_tokens=1000, ignore_eos=True), timeout=60)
    next(stream)  # work is pending
    release = threading.Event()
    engine = cluster.pds[0].engine
    frozen = asyncio.run_coroutine_threadsafe(engine.call(release.wait, 30), cluster.loop)
    try:
        _wait_for(lambda: _ready_status(address) == not_serving, what="NOT_SERVING")
        assert engine.stalled_for() > STALL_TIMEOUT_S
    finally:
        release.set()
    assert frozen.result(10) is True
    _wait_for(lambda: _ready_status(address) == serving, what="SERVING again")
    stream.cancel()


def test_a_generate_cancelled_during_admission_leaves_no_orphaned_generation(stub, cluster):
    """First review: when Generate was cancelled while its admission was queued, the request was admitted
    afterwards with no one to abort it, and ran to its max_tokens holding KV."""
    engine = cluster.pds[0].engine
    release = threading.Event()
    frozen = asyncio.run_coroutine_threadsafe(engine.call(release.wait, 30), cluster.loop)
    try:
        request = _request(new_request_id(), [1, 2, 3], max_tokens=2000, ignore_eos=True)  # seconds of decoding
        with pytest.raises(grpc.RpcError) as info:
            next(stub.Generate(request, timeout=0.5))  # admission waits behind the frozen engine thread
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
    assert frozen.result(10) is True

    def unfinished() -> bool:
        return asyncio.run_coroutine_threadsafe(
            engine.call(engine.core.scheduler.has_unfinished_requests), cluster.loop
        ).result(10)

    _wait_for(lambda: not unfinished(), timeout=2.0, what="no request left in the engine")

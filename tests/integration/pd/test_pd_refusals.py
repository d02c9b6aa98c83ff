"""PD refuses what would hurt it, precisely, and keeps serving (reliability defects 1, 2, 6, 7, 8, 12).

A raw gRPC client plays proxy and encoder against one in-process PD on the
tiny model. After every test nothing is left reserved, pending or referenced.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from cluster_support import InProcessCluster
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pd_client import greedy, new_request_id, push_chunks, run_generate, single_pd

from services.common.pb import epd_pb2

IDLE_TIMEOUT_S = 0.5
MAX_ITEMS = 4
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dir):
    yield from single_pd(
        tiny_model_dir, embedding_cache_tokens=64, push_idle_timeout_s=IDLE_TIMEOUT_S, max_items_per_request=MAX_ITEMS
    )


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _image_request(adapter, mm_hash: str, num_tokens: int = NUM_TOKENS):
    prompt = [5, 5, 5] + [adapter.image_token_id] * num_tokens + [6, 6, 6]
    return prompt, [epd_pb2.MultiModalItem(mm_hash=mm_hash, offset=3, num_tokens=num_tokens)]


def _reserve(stub, adapter, mm_hash: str, lease_ms: int = 0):
    request_id = new_request_id()
    prompt, items = _image_request(adapter, mm_hash)
    reply = stub.Preallocate(
        epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items, lease_ms=lease_ms)
    )
    assert reply.items[0].state == epd_pb2.ItemAllocation.RESERVED
    return request_id, reply.items[0].reservation_id, prompt, items


def _generate(stub, request_id, prompt, items):
    request = epd_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, mm_items=items, sampling=greedy(4, ignore_eos=True)
    )
    return run_generate(stub, request)


def _stats(pd_cluster):
    return pd_cluster.run(pd_cluster.pds[0].stats())


# -- 1: poisoning -------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_embedding_is_refused_and_the_reservation_stays_open(stub, adapter, pd_cluster, bad):
    mm_hash = ("1" if bad != bad else "2") * 64
    request_id, reservation_id, prompt, items = _reserve(stub, adapter, mm_hash)
    poisoned = torch.randn(NUM_TOKENS, adapter.hidden_size)
    poisoned[3, 5] = bad
    push = push_chunks(request_id, reservation_id, mm_hash, poisoned)
    assert _code(lambda: stub.PushEmbedding(push)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _stats(pd_cluster).reserved_tokens == NUM_TOKENS  # nothing landed; still waiting for a push
    stub.PushEmbedding(push_chunks(request_id, reservation_id, mm_hash, torch.randn(NUM_TOKENS, adapter.hidden_size)))
    token_ids, _, _ = _generate(stub, request_id, prompt, items)
    assert len(token_ids) == 4


# -- 2: limits before work ------------------------------------------------------


def test_preallocate_refuses_a_prompt_longer_than_the_context(stub, adapter, pd_cluster):
    max_model_len = pd_cluster.pds[0].servicer.max_model_len
    prompt = [5] * 3 + [adapter.image_token_id] * NUM_TOKENS + [6] * max_model_len
    items = [epd_pb2.MultiModalItem(mm_hash="3" * 64, offset=3, num_tokens=NUM_TOKENS)]
    call = lambda: stub.Preallocate(
        epd_pb2.PreallocateRequest(request_id=new_request_id(), prompt_token_ids=prompt, items=items)
    )
    assert _code(call) == grpc.StatusCode.INVALID_ARGUMENT
    assert _stats(pd_cluster).num_reservations == 0


def test_preallocate_and_generate_refuse_too_many_items(stub, adapter, pd_cluster):
    num_items = MAX_ITEMS + 1
    prompt = [adapter.image_token_id] * num_items + [6]
    items = [epd_pb2.MultiModalItem(mm_hash=f"{i:064x}", offset=i, num_tokens=1) for i in range(num_items)]
    preallocate = lambda: stub.Preallocate(
        epd_pb2.PreallocateRequest(request_id=new_request_id(), prompt_token_ids=prompt, items=items)
    )
    assert _code(preallocate) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: _generate(stub, new_request_id(), prompt, items)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _stats(pd_cluster).num_reservations == 0


def test_preallocate_and_generate_refuse_a_malformed_cache_salt_without_echoing_it(stub, adapter, pd_cluster):
    prompt, items = _image_request(adapter, "4" * 64)
    salt = "tenant-secret"  # the wire carries a 64-hex digest, never a client's own salt
    with pytest.raises(grpc.RpcError) as refused:
        stub.Preallocate(
            epd_pb2.PreallocateRequest(
                request_id=new_request_id(), prompt_token_ids=prompt, items=items, cache_salt=salt
            )
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and salt not in refused.value.details()
    generate = epd_pb2.GenerateRequest(
        request_id=new_request_id(), prompt_token_ids=[5, 6], sampling=greedy(2), cache_salt=salt
    )
    assert _code(lambda: run_generate(stub, generate)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _stats(pd_cluster).num_reservations == 0


def test_a_message_bigger_than_any_legitimate_one_is_refused_by_the_transport(stub, pd_cluster):
    max_model_len = pd_cluster.pds[0].servicer.max_model_len
    huge = epd_pb2.GenerateRequest(request_id=new_request_id(), prompt_token_ids=[1] * (8 * max_model_len + 3_000_000))
    assert huge.ByteSize() > 3_000_000
    assert _code(lambda: run_generate(stub, huge)) == grpc.StatusCode.RESOURCE_EXHAUSTED


# -- 6: one push in flight per reservation, and an idle timeout ------------------


def _stalled_push(request_id, reservation_id, mm_hash, embedding, release: threading.Event):
    """A push that sends its header and first chunk, then waits for ``release``."""
    chunks = list(push_chunks(request_id, reservation_id, mm_hash, embedding, chunk_bytes=1024))
    yield chunks[0]
    yield chunks[1]
    release.wait(10)
    yield from chunks[2:]


def test_a_second_push_to_a_reservation_in_flight_is_refused(stub, adapter):
    mm_hash = "4" * 64
    request_id, reservation_id, prompt, items = _reserve(stub, adapter, mm_hash)
    embedding = torch.randn(NUM_TOKENS, adapter.hidden_size)
    release = threading.Event()
    first = stub.PushEmbedding.future(_stalled_push(request_id, reservation_id, mm_hash, embedding, release))
    time.sleep(0.2)
    second = lambda: stub.PushEmbedding(push_chunks(request_id, reservation_id, mm_hash, embedding))
    assert _code(second) == grpc.StatusCode.FAILED_PRECONDITION
    release.set()
    assert first.result(timeout=10).num_bytes == embedding.numel() * 4
    assert len(_generate(stub, request_id, prompt, items)[0]) == 4


def test_a_push_that_stops_sending_is_ended(stub, adapter, pd_cluster):
    mm_hash = "5" * 64
    request_id, reservation_id, prompt, items = _reserve(stub, adapter, mm_hash)
    release = threading.Event()
    embedding = torch.randn(NUM_TOKENS, adapter.hidden_size)
    stalled = _stalled_push(request_id, reservation_id, mm_hash, embedding, release)
    try:
        assert _code(lambda: stub.PushEmbedding(stalled, timeout=10)) == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
    assert _stats(pd_cluster).reserved_tokens == NUM_TOKENS  # the reservation still waits for a push
    stub.Abort(epd_pb2.AbortRequest(request_id=request_id))


# -- 7: a span that disagrees with the cached entry -----------------------------


def test_generate_with_a_span_length_other_than_the_cached_entry_fails_alone(stub, adapter):
    mm_hash = "6" * 64
    request_id, reservation_id, prompt, items = _reserve(stub, adapter, mm_hash)
    stub.PushEmbedding(push_chunks(request_id, reservation_id, mm_hash, torch.randn(NUM_TOKENS, adapter.hidden_size)))
    results: list = []
    bystander = threading.Thread(target=lambda: results.append(_generate(stub, request_id, prompt, items)))
    bystander.start()
    short_prompt, short_items = _image_request(adapter, mm_hash, num_tokens=NUM_TOKENS - 4)
    for _ in range(3):  # and again: nothing is poisoned by it
        call = lambda: _generate(stub, new_request_id(), short_prompt, short_items)
        assert _code(call) == grpc.StatusCode.INVALID_ARGUMENT
    bystander.join(30)
    assert len(results[0][0]) == 4


# -- 12: a repeated push, and a push after the lease ------------------------------


def test_a_repeat_of_a_push_that_landed_is_acknowledged(stub, adapter):
    mm_hash = "7" * 64
    request_id, reservation_id, prompt, items = _reserve(stub, adapter, mm_hash)
    embedding = torch.randn(NUM_TOKENS, adapter.hidden_size)
    stub.PushEmbedding(push_chunks(request_id, reservation_id, mm_hash, embedding))
    again = stub.PushEmbedding(push_chunks(request_id, reservation_id, mm_hash, torch.zeros_like(embedding)))
    assert again.num_bytes == embedding.numel() * 4  # e.g. an Encode retried on another encoder
    first = _generate(stub, request_id, prompt, items)[0]
    # The repeat carried nothing new: the same image, with the first push's rows, answers the same.
    other, other_reservation, _, _ = _reserve(stub, adapter, "8" * 64)
    stub.PushEmbedding(push_chunks(other, other_reservation, "8" * 64, embedding))
    other_prompt, other_items = _image_request(adapter, "8" * 64)
    assert _generate(stub, other, other_prompt, other_items)[0] == first


def test_a_push_after_the_lease_is_a_timeout(stub, adapter, pd_cluster):
    mm_hash = "9" * 64
    request_id, reservation_id, _, _ = _reserve(stub, adapter, mm_hash, lease_ms=100)
    time.sleep(0.2)
    embedding = torch.randn(NUM_TOKENS, adapter.hidden_size)
    push = lambda: stub.PushEmbedding(push_chunks(request_id, reservation_id, mm_hash, embedding))
    assert _code(push) == grpc.StatusCode.DEADLINE_EXCEEDED  # the proxy answers 504, not 500
    stub.Abort(epd_pb2.AbortRequest(request_id=request_id))


# -- 8: the engine thread -------------------------------------------------------


def test_a_failing_abort_does_not_stop_the_engine(stub, pd_cluster, monkeypatch):
    core = pd_cluster.pds[0].engine.core

    def broken_abort(request_id):
        raise RuntimeError("abort failed")

    monkeypatch.setattr(core, "abort", broken_abort)
    stub.Abort(epd_pb2.AbortRequest(request_id=new_request_id()))
    time.sleep(0.2)
    monkeypatch.undo()
    assert pd_cluster.pds[0].engine.is_alive
    request = epd_pb2.GenerateRequest(
        request_id=new_request_id(), prompt_token_ids=[1, 2, 3], sampling=greedy(2, ignore_eos=True)
    )
    assert len(run_generate(stub, request)[0]) == 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_turns_liveness_off(tiny_model_dir):
    cluster = InProcessCluster(str(tiny_model_dir), num_encoders=0, with_proxy=False).start()
    try:
        pd = cluster.pds[0]

        def broken_step():
            raise RuntimeError("engine bug")

        pd.engine.core.step = broken_step
        with grpc.insecure_channel(cluster.pd_addresses[0]) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 10
            status = None
            while time.monotonic() < deadline:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            ready = health.Check(health_pb2.HealthCheckRequest(service="epd.v1.PrefillDecode"), timeout=5)
            assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not pd.engine.is_alive and pd.engine_dead.is_set()
    finally:
        cluster.stop()

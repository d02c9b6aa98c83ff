"""PD over real gRPC on loopback: the hand-off protocol and every failure branch.

A raw gRPC client plays proxy and encoder, so each status code can be
driven on purpose. After every test nothing is left reserved, pending or
referenced on PD.
"""

from __future__ import annotations

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
from services.common.pb import epd_pb2

HASH_A = "a" * 64
HASH_B = "b" * 64


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dir):
    cluster = InProcessCluster(
        str(tiny_model_dir), num_encoders=0, with_proxy=False, pd={"embedding_cache_tokens": 64}
    ).start()
    yield cluster
    cluster.stop()


def _generate(stub, request_id, prompt, items=(), sampling=None, timeout=60):
    """Runs Generate to the end; returns (token_ids, text, final message)."""
    request = epd_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, mm_items=list(items), sampling=sampling or greedy()
    )
    return run_generate(stub, request, timeout)


def _image_prompt(adapter, num_tokens, prefix=3, suffix=3):
    prompt = [5] * prefix + [adapter.image_token_id] * num_tokens + [6] * suffix
    return prompt, prefix


def _code(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


# -- the happy path -------------------------------------------------------


def test_health_reports_ready_and_alive(pd_cluster):
    with grpc.insecure_channel(pd_cluster.pd_addresses[0]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "epd.v1.PrefillDecode"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_text_generation_streams_tokens_and_usage(stub):
    token_ids, text, final = _generate(stub, new_request_id(), [1, 7, 8, 9, 10], sampling=greedy(6, ignore_eos=True))
    assert len(token_ids) == 6
    assert final.finish_reason == epd_pb2.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == 5 and final.usage.completion_tokens == 6
    assert final.usage.timings.decode_ms >= 0


def test_preallocate_push_generate(stub, adapter):
    num_tokens = 16
    prompt, offset = _image_prompt(adapter, num_tokens)
    request_id = new_request_id()
    items = [epd_pb2.MultiModalItem(mm_hash=HASH_A, offset=offset, num_tokens=num_tokens)]
    reply = stub.Preallocate(epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items))
    assert reply.items[0].state == epd_pb2.ItemAllocation.RESERVED and reply.lease_ms > 0
    embedding = torch.randn(num_tokens, adapter.hidden_size)
    pushed = stub.PushEmbedding(push_chunks(request_id, reply.items[0].reservation_id, HASH_A, embedding))
    assert pushed.num_bytes == embedding.numel() * 4
    token_ids, _, final = _generate(stub, request_id, prompt, items)
    assert final.usage.image_tokens == num_tokens and token_ids
    # The same image again is READY (cached on PD): no push needed.
    again = new_request_id()
    reply = stub.Preallocate(epd_pb2.PreallocateRequest(request_id=again, prompt_token_ids=prompt, items=items))
    assert reply.items[0].state == epd_pb2.ItemAllocation.READY
    assert _generate(stub, again, prompt, items)[0] == token_ids


def test_generate_waits_for_a_push_that_arrives_later(stub, adapter):
    prompt, offset = _image_prompt(adapter, 16, prefix=20)
    request_id = new_request_id()
    items = [epd_pb2.MultiModalItem(mm_hash=HASH_B, offset=offset, num_tokens=16)]
    reply = stub.Preallocate(epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items))
    reservation = reply.items[0].reservation_id

    def push_later():
        time.sleep(0.3)
        stub.PushEmbedding(push_chunks(request_id, reservation, HASH_B, torch.randn(16, adapter.hidden_size)))

    pusher = threading.Thread(target=push_later)
    pusher.start()
    _, _, final = _generate(stub, request_id, prompt, items)
    pusher.join()
    assert final.usage.timings.embedding_wait_ms >= 100


def test_stop_string_ends_generation_before_it(stub):
    prompt = [1, 11, 12, 13]
    _, full_text, _ = _generate(stub, new_request_id(), prompt, sampling=greedy(16, ignore_eos=True))
    stop = full_text[4:7]
    assert stop, "tiny model produced too little text for this test"
    _, text, final = _generate(stub, new_request_id(), prompt, sampling=greedy(16, ignore_eos=True, stop=[stop]))
    assert stop not in text and full_text.startswith(text)
    assert final.finish_reason == epd_pb2.FINISH_REASON_STOP


def test_get_load_reports_capacity(stub):
    load = stub.GetLoad(epd_pb2.GetLoadRequest())
    assert load.num_kv_blocks_total > 0 and load.embedding_tokens_capacity == 64


# -- invalid input ----------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r.ClearField("request_id"),
        lambda r: setattr(r, "request_id", "x" * 200),
        lambda r: r.ClearField("prompt_token_ids"),
        lambda r: r.prompt_token_ids.append(10**9),
        lambda r: r.mm_items.add(mm_hash="not-a-hash", offset=0, num_tokens=1),
        lambda r: r.mm_items.add(mm_hash=HASH_A, offset=2, num_tokens=50),
        lambda r: r.mm_items.add(mm_hash=HASH_A, offset=0, num_tokens=0),
        lambda r: (
            r.mm_items.add(mm_hash=HASH_A, offset=1, num_tokens=2),
            r.mm_items.add(mm_hash=HASH_B, offset=2, num_tokens=1),
        ),
        lambda r: setattr(r.sampling, "temperature", -1.0),
        lambda r: setattr(r.sampling, "top_p", 0.0),
        lambda r: setattr(r.sampling, "logprobs", 50),
        lambda r: r.sampling.stop.append(""),
        lambda r: r.prompt_token_ids.extend([1] * 5000),
    ],
    ids=[
        "no-id",
        "long-id",
        "empty-prompt",
        "oov-token",
        "bad-hash",
        "span-past-end",
        "empty-span",
        "overlapping-spans",
        "negative-temperature",
        "zero-top-p",
        "too-many-logprobs",
        "empty-stop",
        "prompt-too-long",
    ],
)
def test_invalid_generate_is_rejected(stub, change):
    request = epd_pb2.GenerateRequest(request_id=new_request_id(), prompt_token_ids=[1, 2, 3, 4], sampling=greedy())
    change(request)
    assert _code(lambda: list(stub.Generate(request, timeout=10))) == grpc.StatusCode.INVALID_ARGUMENT


def test_image_without_reservation_is_a_failed_precondition(stub, adapter):
    prompt, offset = _image_prompt(adapter, 16)
    items = [epd_pb2.MultiModalItem(mm_hash="c" * 64, offset=offset, num_tokens=16)]
    call = lambda: _generate(stub, new_request_id(), prompt, items)
    assert _code(call) == grpc.StatusCode.FAILED_PRECONDITION


def test_duplicate_running_request_id_is_rejected(stub):
    request_id = new_request_id()
    request = epd_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3], sampling=greedy(400, ignore_eos=True)
    )
    first = stub.Generate(request, timeout=60)
    next(first)
    assert _code(lambda: list(stub.Generate(request, timeout=10))) == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()


# -- the push protocol ---------------------------------------------------------


@pytest.fixture
def reservation(stub, adapter):
    """A live reservation of 16 tokens; cancelled (via Abort) after the test."""
    prompt, offset = _image_prompt(adapter, 16)
    request_id = new_request_id()
    mm_hash = uuid.uuid4().hex * 2
    items = [epd_pb2.MultiModalItem(mm_hash=mm_hash, offset=offset, num_tokens=16)]
    reply = stub.Preallocate(epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items))
    yield request_id, reply.items[0].reservation_id, mm_hash
    stub.Abort(epd_pb2.AbortRequest(request_id=request_id))


def test_push_must_start_with_a_header(stub, reservation):
    chunks = iter([epd_pb2.PushEmbeddingChunk(data=b"\0" * 8)])
    assert _code(lambda: stub.PushEmbedding(chunks)) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "embedding",
    [torch.zeros(16, 7), torch.zeros(15, 64), torch.zeros(16, 64, dtype=torch.uint8)],
    ids=["wrong-width", "wrong-rows", "wrong-dtype"],
)
def test_push_with_wrong_shape_or_dtype_is_rejected(stub, reservation, embedding):
    request_id, reservation_id, mm_hash = reservation
    code = _code(lambda: stub.PushEmbedding(push_chunks(request_id, reservation_id, mm_hash, embedding)))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


def test_push_with_extra_bytes_is_rejected(stub, reservation, adapter):
    request_id, reservation_id, mm_hash = reservation
    chunks = push_chunks(request_id, reservation_id, mm_hash, torch.zeros(16, adapter.hidden_size), extra=b"\0" * 4)
    assert _code(lambda: stub.PushEmbedding(chunks)) == grpc.StatusCode.FAILED_PRECONDITION


def test_truncated_push_is_rejected(stub, reservation, adapter):
    request_id, reservation_id, mm_hash = reservation
    chunks = list(push_chunks(request_id, reservation_id, mm_hash, torch.zeros(16, adapter.hidden_size), 1024))
    assert _code(lambda: stub.PushEmbedding(iter(chunks[:-1]))) == grpc.StatusCode.INVALID_ARGUMENT


def test_push_with_mismatched_ids_is_rejected(stub, reservation, adapter):
    request_id, reservation_id, mm_hash = reservation
    embedding = torch.zeros(16, adapter.hidden_size)
    assert _code(lambda: stub.PushEmbedding(push_chunks("other", reservation_id, mm_hash, embedding))) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    assert _code(lambda: stub.PushEmbedding(push_chunks(request_id, reservation_id, HASH_B, embedding))) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    assert _code(lambda: stub.PushEmbedding(push_chunks(request_id, "no-such-id", mm_hash, embedding))) == (
        grpc.StatusCode.NOT_FOUND
    )


def test_push_after_abort_is_rejected(stub, reservation, adapter):
    request_id, reservation_id, mm_hash = reservation
    stub.Abort(epd_pb2.AbortRequest(request_id=request_id))
    time.sleep(0.1)
    embedding = torch.zeros(16, adapter.hidden_size)
    code = _code(lambda: stub.PushEmbedding(push_chunks(request_id, reservation_id, mm_hash, embedding)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_lease_expiry_fails_the_waiting_request(stub, adapter):
    prompt, offset = _image_prompt(adapter, 16)
    request_id = new_request_id()
    items = [epd_pb2.MultiModalItem(mm_hash="d" * 64, offset=offset, num_tokens=16)]
    stub.Preallocate(
        epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items, lease_ms=300)
    )
    started = time.monotonic()
    assert _code(lambda: _generate(stub, request_id, prompt, items)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3.0


def test_full_embedding_cache_answers_resource_exhausted_with_retry_after(stub, adapter):
    prompt, offset = _image_prompt(adapter, 48)
    holder = new_request_id()
    items = [epd_pb2.MultiModalItem(mm_hash="e" * 64, offset=offset, num_tokens=48)]
    stub.Preallocate(epd_pb2.PreallocateRequest(request_id=holder, prompt_token_ids=prompt, items=items))
    others = [epd_pb2.MultiModalItem(mm_hash="f" * 64, offset=offset, num_tokens=48)]
    with pytest.raises(grpc.RpcError) as info:
        stub.Preallocate(epd_pb2.PreallocateRequest(request_id=new_request_id(), prompt_token_ids=prompt, items=others))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    hints = dict(info.value.trailing_metadata())
    assert int(hints[RETRY_AFTER_KEY]) > 0
    stub.Abort(epd_pb2.AbortRequest(request_id=holder))


def test_abort_ends_a_running_stream(stub):
    request_id = new_request_id()
    request = epd_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3], sampling=greedy(1000, ignore_eos=True)
    )
    stream = stub.Generate(request, timeout=60)
    next(stream)
    stub.Abort(epd_pb2.AbortRequest(request_id=request_id))
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED


def test_client_cancel_frees_the_request(stub, pd_cluster):
    request = epd_pb2.GenerateRequest(
        request_id=new_request_id(), prompt_token_ids=[1, 2, 3], sampling=greedy(1000, ignore_eos=True)
    )
    stream = stub.Generate(request, timeout=60)
    next(stream)
    stream.cancel()
    # The stub fixture's leak check then proves PD released it.


def test_abort_of_unknown_request_is_not_an_error(stub):
    stub.Abort(epd_pb2.AbortRequest(request_id="never-seen"))

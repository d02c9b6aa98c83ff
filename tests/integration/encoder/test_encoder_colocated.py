"""Colocated mode's Encode (``services/pd/colocated.py``) against a real PD, over gRPC and directly.

Covers every failure branch: invalid input, unknown or dead reservations,
deadlines, cancellation, a failing vision module, a wrong warm-up shape;
and the sharing rules: images queued together share one forward, an image
already READY on PD is not computed again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
import time
from concurrent.futures import Future

import grpc
import pytest
import torch
from cluster_support import InProcessCluster

from services.common import grpc_utils, tensors
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.pd.colocated import ColocatedEncoder, ColocatedItem
from services.pd.engine.engine_stats import EngineStats
from services.pd.engine.errors import EngineError, ErrorKind


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cluster = InProcessCluster(
        str(tiny_model_dir), num_encoders=0, with_proxy=False, pd={"encoder": "local", "accept_pixel_values": True}
    )
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def pd(cluster):
    yield cluster.pds[0]
    assert cluster.leaks() == {}
    assert cluster.pds[0].colocated.encoder.num_pending == 0


def mm_hash_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def pixels(pd, seed: int) -> torch.Tensor:
    sample = pd.colocated.encoder.vision.sample_pixels
    return sample + torch.randn(sample.shape, generator=torch.Generator().manual_seed(seed))


async def preallocate(pd, request_id: str, mm_hash: str) -> str:
    n = pd.colocated.encoder.vision.num_tokens
    async with grpc_utils.aio_channel(pd.address) as channel:
        reply = await epd_pb2_grpc.PrefillDecodeStub(channel).Preallocate(
            epd_pb2.PreallocateRequest(
                request_id=request_id,
                prompt_token_ids=[1] * n,
                items=[epd_pb2.MultiModalItem(mm_hash=mm_hash, offset=0, num_tokens=n)],
            ),
            timeout=5,
        )
    return reply.items[0].reservation_id


async def encode(
    pd, request_id: str, items: list[tuple[str, str, torch.Tensor]], timeout: float = 10, cache_salt: str = ""
):
    request = epd_pb2.EncodeRequest(
        request_id=request_id,
        pd_address=pd.address,
        cache_salt=cache_salt,
        items=[epd_pb2.EncodeItem(mm_hash=h, reservation_id=r, pixel_values=tensors.to_pb(p)) for h, r, p in items],
    )
    async with grpc_utils.aio_channel(pd.address) as channel:
        return await epd_pb2_grpc.EncoderStub(channel).Encode(request, timeout=timeout)


async def abort(pd, *request_ids: str) -> None:
    for request_id in request_ids:
        pd.engine.abort(request_id)
    await pd.engine.stats()  # the aborts ran: the inbox is FIFO


def stats(cluster, pd) -> EngineStats:
    return cluster.run(pd.stats())


def test_encode_fills_the_reservation_and_reports_load(cluster, pd) -> None:
    mm_hash = mm_hash_of("fill")
    rid = cluster.run(preallocate(pd, "req-fill", mm_hash))
    reply = cluster.run(encode(pd, "req-fill", [(mm_hash, rid, pixels(pd, 1))]))
    assert not reply.items[0].cache_hit and reply.items[0].encode_ms > 0
    assert stats(cluster, pd).reserved_tokens == 0

    async def load():
        async with grpc_utils.aio_channel(pd.address) as channel:
            return await epd_pb2_grpc.EncoderStub(channel).GetLoad(epd_pb2.GetLoadRequest(), timeout=5)

    assert cluster.run(load()).num_pending == 0
    cluster.run(abort(pd, "req-fill"))


def test_invalid_input_and_unknown_reservation(cluster, pd) -> None:
    good = pixels(pd, 2)
    cases = {
        "no items": ("req-x", []),
        "no reservation id": ("req-x", [(mm_hash_of("x"), "", good)]),
        "bad pixels": ("req-x", [(mm_hash_of("x"), "r", torch.zeros(1, 4, 4))]),
        "integer pixels": ("req-x", [(mm_hash_of("x"), "r", torch.zeros(3, 4, 4, dtype=torch.uint8))]),
        "no request id": ("", [(mm_hash_of("x"), "r", good)]),
    }
    for name, (request_id, items) in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            cluster.run(encode(pd, request_id, items))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    with pytest.raises(grpc.aio.AioRpcError) as info:  # a wire salt is a 64-hex digest; not echoed
        cluster.run(encode(pd, "req-x", [(mm_hash_of("x"), "r", good)], cache_salt="tenant-secret"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant-secret" not in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        cluster.run(encode(pd, "req-x", [(mm_hash_of("x"), "no-such-reservation", good)]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_aborted_request_reservation_is_rejected(cluster, pd) -> None:
    mm_hash = mm_hash_of("aborted")
    rid = cluster.run(preallocate(pd, "req-aborted", mm_hash))
    cluster.run(abort(pd, "req-aborted"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        cluster.run(encode(pd, "req-aborted", [(mm_hash, rid, pixels(pd, 3))]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _item(pd, request_id: str, reservation_id: str, mm_hash: str, seed: int, deadline: float) -> ColocatedItem:
    return ColocatedItem(request_id, reservation_id, mm_hash, pixels(pd, seed), deadline)


def test_dead_item_is_dropped_before_encoding(cluster, pd) -> None:
    mm_hash = mm_hash_of("dead")
    rid = cluster.run(preallocate(pd, "req-dead", mm_hash))
    encoder = pd.colocated.encoder
    start = encoder.num_images_encoded
    with pytest.raises(EngineError) as info:
        cluster.run(encoder.encode([_item(pd, "req-dead", rid, mm_hash, 4, deadline=0.0)]))
    assert info.value.kind is ErrorKind.DEADLINE_EXCEEDED
    assert encoder.num_images_encoded == start
    cluster.run(abort(pd, "req-dead"))


def _block_engine(cluster, pd) -> tuple[threading.Event, Future]:
    """Holds the engine thread (as a long step would) until the returned event is set."""
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(10)

    future = asyncio.run_coroutine_threadsafe(pd.engine.call(hold), cluster.loop)
    assert entered.wait(5)
    return gate, future


def _wait_pending(encoder: ColocatedEncoder, count: int) -> None:
    end = time.monotonic() + 5
    while encoder.num_pending != count:
        assert time.monotonic() < end, f"pending stayed at {encoder.num_pending}"
        time.sleep(0.005)


def test_cancelled_call_is_skipped_and_queued_images_share_one_forward(cluster, pd) -> None:
    encoder = pd.colocated.encoder
    hashes = [mm_hash_of(f"shared-{i}") for i in range(3)]
    rids = [cluster.run(preallocate(pd, f"req-shared-{i}", h)) for i, h in enumerate(hashes)]
    start = encoder.num_images_encoded
    gate, held = _block_engine(cluster, pd)
    calls = [
        asyncio.run_coroutine_threadsafe(
            encode(pd, f"req-shared-{i}", [(hashes[i], rids[i], pixels(pd, 10 + i))]), cluster.loop
        )
        for i in range(3)
    ]
    _wait_pending(encoder, 3)
    calls[2].cancel()  # the client goes away while its image is queued
    _wait_pending(encoder, 2)  # withdrawn at once
    gate.set()
    replies = [call.result(10) for call in calls[:2]]
    held.result(5)
    assert all(not reply.items[0].cache_hit for reply in replies)
    assert replies[0].items[0].encode_ms == replies[1].items[0].encode_ms  # the same forward's time
    assert encoder.num_images_encoded == start + 2  # one forward for the two live images, none for the third
    assert stats(cluster, pd).reserved_tokens == pd.colocated.encoder.vision.num_tokens  # the cancelled one
    cluster.run(abort(pd, *[f"req-shared-{i}" for i in range(3)]))


def test_image_ready_on_pd_is_not_computed_again(cluster, pd) -> None:
    mm_hash = mm_hash_of("twice")
    first = cluster.run(preallocate(pd, "req-twice-1", mm_hash))
    second = cluster.run(preallocate(pd, "req-twice-2", mm_hash))  # joins the pending entry
    encoder = pd.colocated.encoder
    start = encoder.num_images_encoded
    cluster.run(encode(pd, "req-twice-1", [(mm_hash, first, pixels(pd, 20))]))
    reply = cluster.run(encode(pd, "req-twice-2", [(mm_hash, second, pixels(pd, 20))]))
    assert reply.items[0].cache_hit and encoder.num_images_encoded == start + 1
    assert stats(cluster, pd).num_reservations == 2  # both filled, held until their requests end
    cluster.run(abort(pd, "req-twice-1", "req-twice-2"))


class FailingVision(torch.nn.Module):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure")


def test_vision_failure_is_internal_and_the_engine_keeps_serving(cluster, pd) -> None:
    vision = dataclasses.replace(pd.colocated.encoder.vision, module=FailingVision())
    broken = ColocatedEncoder(pd.engine, vision)
    mm_hash = mm_hash_of("broken")
    rid = cluster.run(preallocate(pd, "req-broken", mm_hash))
    with pytest.raises(EngineError) as info:
        cluster.run(broken.encode([_item(pd, "req-broken", rid, mm_hash, 30, deadline=float("inf"))]))
    assert info.value.kind is ErrorKind.INTERNAL
    cluster.run(encode(pd, "req-broken", [(mm_hash, rid, pixels(pd, 30))]))  # the real one still works
    cluster.run(abort(pd, "req-broken"))


def test_warm_up_with_the_wrong_shape_fails(cluster, pd) -> None:
    vision = dataclasses.replace(pd.colocated.encoder.vision, num_tokens=pd.colocated.encoder.vision.num_tokens + 1)
    with pytest.raises(RuntimeError):
        cluster.run(ColocatedEncoder(pd.engine, vision).warm_up())


def test_encoder_health(cluster, pd) -> None:
    address = pd.address
    assert cluster.run(grpc_utils.check_health(address, "epd.v1.Encoder"))
    cluster.run(pd.colocated.set_ready(pd.grpc, False))  # what stop() does first
    try:
        assert not cluster.run(grpc_utils.check_health(address, "epd.v1.Encoder"))
        assert cluster.run(grpc_utils.check_health(address, "epd.v1.PrefillDecode"))
    finally:
        cluster.run(pd.colocated.set_ready(pd.grpc, True))


def test_ready_image_with_a_dead_or_unknown_reservation_is_rejected(cluster, pd) -> None:
    mm_hash = mm_hash_of("ready-dead")
    live = cluster.run(preallocate(pd, "req-ready-live", mm_hash))
    dead = cluster.run(preallocate(pd, "req-ready-dead", mm_hash))
    cluster.run(encode(pd, "req-ready-live", [(mm_hash, live, pixels(pd, 40))]))  # the image is READY now
    cluster.run(abort(pd, "req-ready-dead"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        cluster.run(encode(pd, "req-ready-dead", [(mm_hash, dead, pixels(pd, 40))]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as info:
        cluster.run(encode(pd, "req-ready-dead", [(mm_hash, "no-such-reservation", pixels(pd, 40))]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    cluster.run(abort(pd, "req-ready-live"))

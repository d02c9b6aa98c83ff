"""Encoder server over real gRPC on 127.0.0.1: pushes to a fake PD, caching, errors, health, leaks.

``FakeVision`` stands in for the vision tower (a deterministic function of
the pixels); ``FakePdServicer`` implements only ``PushEmbedding`` and records
what arrives. After every test the encoder must hold nothing pending and no
outbound bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from dataclasses import dataclass, field, replace

import grpc
import pytest
import torch
from torch import nn

from services.common import grpc_utils, tensors
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.encoder.config import EncoderConfig
from services.encoder.server import EncoderServer, LoadedVision, start_encoder
from services.proxy.config import ProxyConfig

NUM_TOKENS = 300
HIDDEN = 1024  # 300 x 1024 float32 = 1.2 MB: every push needs two chunks
IMAGE_SIZE = 8


class FakeVision(nn.Module):
    """[N, 3, H, W] -> [N, NUM_TOKENS, HIDDEN]; counts forwards, can block or fail."""

    def __init__(self) -> None:
        super().__init__()
        self.num_forwards = 0
        self.num_images = 0
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_next = False

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        assert self.gate.wait(10), "test gate never opened"
        self.num_forwards += 1
        self.num_images += pixels.shape[0]
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        return expected_embedding(pixels)

    def reset_counts(self) -> None:
        self.num_forwards = self.num_images = 0


def expected_embedding(pixels: torch.Tensor) -> torch.Tensor:
    base = pixels.flatten(1).sum(1)
    return base[:, None, None] + torch.arange(NUM_TOKENS * HIDDEN, dtype=pixels.dtype).view(NUM_TOKENS, HIDDEN)


def pixels_of(value: float) -> torch.Tensor:
    return torch.full((3, IMAGE_SIZE, IMAGE_SIZE), value)


@dataclass
class ReceivedPush:
    header: epd_pb2.EmbeddingHeader
    chunk_sizes: list[int]
    payload: bytes
    request_id_metadata: str


@dataclass
class FakePdServicer(epd_pb2_grpc.PrefillDecodeServicer):
    """Records every PushEmbedding; answers ``fail_with`` (after reading the header) when set."""

    pushes: list[ReceivedPush] = field(default_factory=list)
    num_calls: int = 0
    fail_with: grpc.StatusCode | None = None
    hold: asyncio.Event | None = None  # when set, every push waits for it after its header
    got_header: asyncio.Event = field(default_factory=asyncio.Event)

    async def PushEmbedding(self, request_iterator, context):
        self.num_calls += 1
        header = None
        chunks: list[bytes] = []
        async for message in request_iterator:
            if message.HasField("header"):
                header = message.header
                self.got_header.set()
                if self.fail_with is not None:
                    await context.abort(self.fail_with, "reservation is not pushable")
                if self.hold is not None:
                    await self.hold.wait()
            else:
                chunks.append(message.data)
        metadata = dict(context.invocation_metadata())
        payload = b"".join(chunks)
        self.pushes.append(
            ReceivedPush(header, [len(c) for c in chunks], payload, metadata.get(grpc_utils.REQUEST_ID_KEY, ""))
        )
        return epd_pb2.PushEmbeddingResponse(num_bytes=len(payload))


async def start_fake_pd(port: int = 0) -> tuple[grpc_utils.GrpcServer, FakePdServicer]:
    servicer = FakePdServicer()
    server = await grpc_utils.start_server(
        "127.0.0.1",
        port,
        "epd.v1.PrefillDecode",
        lambda s: epd_pb2_grpc.add_PrefillDecodeServicer_to_server(servicer, s),
    )
    return server, servicer


def fake_loaded_vision(vision: FakeVision) -> LoadedVision:
    return LoadedVision(
        module=vision,
        device=torch.device("cpu"),
        dtype=torch.float32,
        sample_pixels=pixels_of(0.0),
        num_tokens=NUM_TOKENS,
        hidden_size=HIDDEN,
    )


TEST_CONFIG = EncoderConfig(
    host="127.0.0.1", port=0, max_wait_ms=1.0, push_connect_timeout_s=1.0, grace_s=0.5, accept_pixel_values=True
)


async def wait_idle(server: EncoderServer, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if stats.num_pending == 0 and stats.outbound_bytes == 0:
            return
        assert time.monotonic() < end, f"encoder not idle: {stats}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def extra_encoder(config: EncoderConfig, vision: FakeVision):
    """A second encoder with a different config, sharing the test's vision double."""
    encoder = await start_encoder(config, vision=fake_loaded_vision(vision))
    channel = grpc_utils.aio_channel(f"127.0.0.1:{encoder.port}")
    try:
        yield encoder, epd_pb2_grpc.EncoderStub(channel)
        vision.gate.set()
        await wait_idle(encoder)
    finally:
        vision.gate.set()
        await channel.close()
        await encoder.stop(0)


@dataclass
class Cluster:
    encoder: EncoderServer
    vision: FakeVision
    pd: FakePdServicer
    pd_address: str
    stub: epd_pb2_grpc.EncoderStub


@pytest.fixture
async def cluster():
    pd_server, pd = await start_fake_pd()
    vision = FakeVision()
    encoder = await start_encoder(TEST_CONFIG, vision=fake_loaded_vision(vision))
    vision.reset_counts()  # forget the warm-up forward
    channel = grpc_utils.aio_channel(f"127.0.0.1:{encoder.port}")
    try:
        yield Cluster(encoder, vision, pd, f"127.0.0.1:{pd_server.port}", epd_pb2_grpc.EncoderStub(channel))
        vision.gate.set()
        await wait_idle(encoder)
    finally:
        vision.gate.set()
        await channel.close()
        await encoder.stop(0)
        await pd_server.stop(0)


def encode_request(pd_address: str, *values: float, request_id: str = "req-1") -> epd_pb2.EncodeRequest:
    return epd_pb2.EncodeRequest(
        request_id=request_id,
        pd_address=pd_address,
        items=[
            epd_pb2.EncodeItem(mm_hash=f"hash-{v}", reservation_id=f"res-{v}", pixel_values=tensors.to_pb(pixels_of(v)))
            for v in values
        ],
    )


async def test_encode_pushes_chunked_embeddings(cluster: Cluster) -> None:
    reply = await cluster.stub.Encode(encode_request(cluster.pd_address, 1.0, 2.0), timeout=10)
    assert [item.mm_hash for item in reply.items] == ["hash-1.0", "hash-2.0"]
    assert not any(item.cache_hit for item in reply.items)
    assert all(item.encode_ms > 0 and item.push_ms > 0 for item in reply.items)
    assert cluster.vision.num_images == 2
    by_hash = {push.header.mm_hash: push for push in cluster.pd.pushes}
    assert set(by_hash) == {"hash-1.0", "hash-2.0"}
    for value in (1.0, 2.0):
        push = by_hash[f"hash-{value}"]
        want = expected_embedding(pixels_of(value)[None])[0]
        assert push.header.request_id == "req-1" and push.request_id_metadata == "req-1"
        assert push.header.reservation_id == f"res-{value}"
        assert push.header.dtype == epd_pb2.DTYPE_FLOAT32
        assert list(push.header.shape) == [NUM_TOKENS, HIDDEN]
        assert push.header.num_bytes == len(push.payload) == NUM_TOKENS * HIDDEN * 4
        assert len(push.chunk_sizes) == 2 and max(push.chunk_sizes) <= tensors.CHUNK_BYTES
        got = tensors.tensor_from_bytes(push.payload, torch.float32, [NUM_TOKENS, HIDDEN])
        assert torch.equal(got, want)


async def test_second_encode_is_a_cache_hit_and_pushes_again(cluster: Cluster) -> None:
    await cluster.stub.Encode(encode_request(cluster.pd_address, 3.0), timeout=10)
    retry = encode_request(cluster.pd_address, 3.0, request_id="req-2")
    reply = await cluster.stub.Encode(retry, timeout=10)
    assert reply.items[0].cache_hit and reply.items[0].encode_ms == 0.0
    assert cluster.vision.num_forwards == 1
    assert len(cluster.pd.pushes) == 2
    assert cluster.pd.pushes[0].payload == cluster.pd.pushes[1].payload
    load = await cluster.stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
    assert load.cache_bytes == NUM_TOKENS * HIDDEN * 4 and load.num_pending == 0 and load.outbound_bytes == 0


async def test_same_image_twice_in_one_call_is_encoded_once(cluster: Cluster) -> None:
    request = encode_request(cluster.pd_address, 4.0, 4.0)
    request.items[1].reservation_id = "res-other"
    reply = await cluster.stub.Encode(request)  # no deadline: pushes use push_timeout_s
    assert len(reply.items) == 2
    assert cluster.vision.num_images == 1
    assert sorted(p.header.reservation_id for p in cluster.pd.pushes) == ["res-4.0", "res-other"]


@pytest.mark.parametrize(
    ("pd_code", "caller_code"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION),
        (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
        (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),  # after the header: no retry
        (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL),  # our bug, not the caller's
    ],
)
async def test_pd_rejection_maps_to_caller_code_without_retry(
    cluster: Cluster, pd_code: grpc.StatusCode, caller_code: grpc.StatusCode
) -> None:
    cluster.pd.fail_with = pd_code
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.Encode(encode_request(cluster.pd_address, 5.0), timeout=10)
    assert info.value.code() == caller_code
    assert cluster.pd.num_calls == 1


async def test_pd_rejection_mid_stream_keeps_pd_status(cluster: Cluster) -> None:
    # 16 KiB chunks: the encoder is still writing when PD's rejection arrives,
    # so the failed write must not turn PD's status into INTERNAL.
    cluster.pd.fail_with = grpc.StatusCode.FAILED_PRECONDITION
    async with extra_encoder(replace(TEST_CONFIG, push_chunk_bytes=16 * 1024), cluster.vision) as (_, stub):
        for attempt in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Encode(encode_request(cluster.pd_address, 16.0, request_id=f"r{attempt}"), timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert cluster.pd.num_calls == 3


def _bad_requests(pd_address: str) -> dict[str, epd_pb2.EncodeRequest]:
    good = encode_request(pd_address, 6.0)
    no_items = epd_pb2.EncodeRequest(request_id="req-1", pd_address=pd_address)
    no_address = epd_pb2.EncodeRequest(request_id="req-1", items=good.items)
    wrong_shape = encode_request(pd_address, 6.0)
    wrong_shape.items[0].pixel_values.CopyFrom(tensors.to_pb(torch.zeros(1, 4, 4)))
    truncated = encode_request(pd_address, 6.0)
    truncated.items[0].pixel_values.data = truncated.items[0].pixel_values.data[:-4]
    integer_pixels = encode_request(pd_address, 6.0)
    integer_pixels.items[0].pixel_values.CopyFrom(tensors.to_pb(torch.zeros(3, 4, 4, dtype=torch.uint8)))
    no_hash = encode_request(pd_address, 6.0)
    no_hash.items[0].mm_hash = ""
    no_pixels = encode_request(pd_address, 6.0)
    no_pixels.items[0].ClearField("pixel_values")
    bad_salt = encode_request(pd_address, 6.0)
    bad_salt.cache_salt = "res-6.0"  # a wire salt is a 64-hex digest; the value is not echoed
    return {
        "bad_salt": bad_salt,
        "no_items": no_items,
        "no_address": no_address,
        "wrong_shape": wrong_shape,
        "truncated": truncated,
        "integer_pixels": integer_pixels,
        "no_hash": no_hash,
        "no_pixels": no_pixels,
    }


@pytest.mark.parametrize(
    "case",
    ["no_items", "no_address", "wrong_shape", "truncated", "integer_pixels", "no_hash", "no_pixels", "bad_salt"],
)
async def test_bad_input_is_invalid_argument_without_echo(cluster: Cluster, case: str) -> None:
    request = _bad_requests(cluster.pd_address)[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.Encode(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    assert "hash-6.0" not in details and "res-6.0" not in details and cluster.pd_address not in details
    assert cluster.vision.num_forwards == 0 and cluster.pd.num_calls == 0


async def test_queue_full_is_resource_exhausted_with_retry_after(cluster: Cluster) -> None:
    async with extra_encoder(replace(TEST_CONFIG, max_pending=1), cluster.vision) as (encoder, stub):
        cluster.vision.gate.clear()
        cluster.vision.entered.clear()
        busy = asyncio.ensure_future(stub.Encode(encode_request(cluster.pd_address, 7.0), timeout=10))
        await asyncio.to_thread(cluster.vision.entered.wait, 5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Encode(encode_request(cluster.pd_address, 8.0), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (grpc_utils.retry_after_ms(info.value) or 0) > 0
        assert await grpc_utils.check_health(f"127.0.0.1:{encoder.port}", "epd.v1.Encoder")
        cluster.vision.gate.set()
        await busy


async def test_deadline_exceeded_while_queued(cluster: Cluster) -> None:
    cluster.vision.gate.clear()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.Encode(encode_request(cluster.pd_address, 9.0), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cluster.vision.gate.set()
    await wait_idle(cluster.encoder)


async def test_client_cancellation_releases_work(cluster: Cluster) -> None:
    cluster.vision.gate.clear()
    cluster.vision.entered.clear()
    running = cluster.stub.Encode(encode_request(cluster.pd_address, 10.0), timeout=10)
    await asyncio.to_thread(cluster.vision.entered.wait, 5)
    queued = cluster.stub.Encode(encode_request(cluster.pd_address, 11.0), timeout=10)
    await asyncio.sleep(0.1)
    assert cluster.encoder.stats().num_pending == 2
    running.cancel()
    queued.cancel()
    for call in (running, queued):
        with pytest.raises(asyncio.CancelledError):
            await call
    # The queued image is withdrawn at once; the running one finishes (and is cached).
    deadline = time.monotonic() + 5
    while cluster.encoder.stats().num_pending != 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    cluster.vision.gate.set()
    await wait_idle(cluster.encoder)
    assert cluster.vision.num_images == 1
    assert cluster.pd.num_calls == 0


async def test_client_cancellation_during_push_releases_outbound_bytes(cluster: Cluster) -> None:
    cluster.pd.hold = asyncio.Event()
    call = cluster.stub.Encode(encode_request(cluster.pd_address, 15.0), timeout=10)
    await asyncio.wait_for(cluster.pd.got_header.wait(), 5)
    assert cluster.encoder.stats().outbound_bytes == NUM_TOKENS * HIDDEN * 4
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await wait_idle(cluster.encoder)
    cluster.pd.hold.set()
    await asyncio.sleep(0.05)
    assert cluster.pd.pushes == []  # PD saw the stream end without its payload


async def test_outbound_bytes_are_bounded(cluster: Cluster) -> None:
    one_embedding = NUM_TOKENS * HIDDEN * 4
    cluster.pd.hold = asyncio.Event()
    async with extra_encoder(replace(TEST_CONFIG, max_outbound_bytes=one_embedding), cluster.vision) as (enc, stub):
        call = asyncio.ensure_future(stub.Encode(encode_request(cluster.pd_address, 17.0, 18.0), timeout=10))
        await asyncio.wait_for(cluster.pd.got_header.wait(), 5)
        await asyncio.sleep(0.1)
        assert cluster.pd.num_calls == 1  # the second push waits for budget
        assert enc.stats().outbound_bytes == one_embedding
        cluster.pd.hold.set()
        reply = await call
    assert len(reply.items) == 2 and len(cluster.pd.pushes) == 2


async def test_vision_failure_is_internal_and_server_keeps_serving(cluster: Cluster) -> None:
    cluster.vision.fail_next = True
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.Encode(encode_request(cluster.pd_address, 12.0), timeout=10)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    reply = await cluster.stub.Encode(encode_request(cluster.pd_address, 12.0), timeout=10)
    assert not reply.items[0].cache_hit and len(cluster.pd.pushes) == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_unreachable_pd_is_unavailable(cluster: Cluster) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.Encode(encode_request(f"127.0.0.1:{_free_port()}", 13.0), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # Defect 9: the caller learns that the push failed, not the encoder's own work.
    assert grpc_utils.failed_hop(info.value) == grpc_utils.PUSH_HOP


async def test_a_pd_rejection_is_marked_as_the_push_hop_and_own_failures_are_not(cluster: Cluster) -> None:
    cluster.pd.fail_with = grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as rejected:
        await cluster.stub.Encode(encode_request(cluster.pd_address, 21.0), timeout=10)
    assert grpc_utils.failed_hop(rejected.value) == grpc_utils.PUSH_HOP
    cluster.pd.fail_with = None
    cluster.vision.fail_next = True
    with pytest.raises(grpc.aio.AioRpcError) as own:
        await cluster.stub.Encode(encode_request(cluster.pd_address, 22.0), timeout=10)
    assert own.value.code() == grpc.StatusCode.INTERNAL and grpc_utils.failed_hop(own.value) is None


async def test_push_waits_for_a_pd_that_comes_up(cluster: Cluster) -> None:
    port = _free_port()
    call = asyncio.ensure_future(cluster.stub.Encode(encode_request(f"127.0.0.1:{port}", 14.0), timeout=10))
    await asyncio.sleep(0.2)  # the first connection attempt has failed by now
    pd_server, pd = await start_fake_pd(port)
    try:
        reply = await call
        assert len(reply.items) == 1
        assert pd.num_calls == 1 and len(pd.pushes) == 1
    finally:
        await pd_server.stop(0)


async def test_health_not_serving_until_warm_up() -> None:
    vision = FakeVision()
    encoder = await EncoderServer.create(TEST_CONFIG, fake_loaded_vision(vision))
    address = f"127.0.0.1:{encoder.port}"
    try:
        assert await grpc_utils.check_health(address, "")
        assert not await grpc_utils.check_health(address, "epd.v1.Encoder")
        await encoder.become_ready()
        assert vision.num_forwards == 1  # the warm-up forward
        assert await grpc_utils.check_health(address, "epd.v1.Encoder")
        assert encoder.stats().num_cached == 0  # warm-up does not touch the cache
    finally:
        await encoder.stop(0)
    assert not await grpc_utils.check_health(address, "")


async def test_warm_up_shape_mismatch_fails_start() -> None:
    vision = FakeVision()
    wrong = replace(fake_loaded_vision(vision), num_tokens=NUM_TOKENS + 1)
    with pytest.raises(RuntimeError):
        await start_encoder(TEST_CONFIG, vision=wrong)


# ---------------------------------------------------------------- real tiny model


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    from services.common.models import build_checkpoint

    return str(build_checkpoint("tiny", tmp_path_factory.mktemp("encoder-model") / "tiny"))


async def test_tiny_model_embedding_matches_direct_forward(tiny_checkpoint: str) -> None:
    from PIL import Image

    from services.common.models import load_adapter

    adapter = load_adapter(tiny_checkpoint)
    image = Image.new("RGB", (40, 24), color=(200, 30, 90))
    pixels = adapter.load_processor().image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
    with torch.inference_mode():
        want = adapter.load_vision(torch.device("cpu"), torch.float32)(pixels[None])[0]
    assert want.shape == (adapter.num_image_tokens(24, 40), adapter.hidden_size)

    pd_server, pd = await start_fake_pd()
    encoder = await start_encoder(replace(TEST_CONFIG, model=tiny_checkpoint, device="cpu"))
    channel = grpc_utils.aio_channel(f"127.0.0.1:{encoder.port}")
    try:
        request = epd_pb2.EncodeRequest(
            request_id="req-tiny",
            pd_address=f"127.0.0.1:{pd_server.port}",
            items=[epd_pb2.EncodeItem(mm_hash="tiny-1", reservation_id="res-1", pixel_values=tensors.to_pb(pixels))],
        )
        await epd_pb2_grpc.EncoderStub(channel).Encode(request, timeout=30)
        (push,) = pd.pushes
        assert list(push.header.shape) == list(want.shape) and push.header.dtype == epd_pb2.DTYPE_FLOAT32
        got = tensors.tensor_from_bytes(push.payload, torch.float32, list(want.shape))
        torch.testing.assert_close(got, want)
        await wait_idle(encoder)
    finally:
        await channel.close()
        await encoder.stop(0)
        await pd_server.stop(0)


def _file_request(pd_address: str, num_bytes: int) -> epd_pb2.EncodeRequest:
    request = encode_request(pd_address, 6.0)
    request.items[0].ClearField("pixel_values")
    request.items[0].image_file = b"\x89PNG" + b"\0" * (num_bytes - 4)
    return request


async def test_encoder_limits_an_encode_over_the_message_bound_is_refused_unparsed(cluster: Cluster) -> None:
    """Security review: the encoder took 64 MiB messages to Encode."""
    default = EncoderConfig().max_message_bytes
    assert ProxyConfig().max_body_bytes < default < grpc_utils.MAX_MESSAGE_BYTES
    parsed: list[int] = []

    def process_file(data: bytes, *_salt):
        parsed.append(len(data))
        raise ValueError("not an image")

    config = replace(TEST_CONFIG, max_message_bytes=1 << 20)
    vision = replace(fake_loaded_vision(cluster.vision), process_file=process_file)
    encoder = await start_encoder(config, vision=vision)
    try:
        async with grpc_utils.aio_channel(f"127.0.0.1:{encoder.port}") as channel:
            stub = epd_pb2_grpc.EncoderStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Encode(_file_request(cluster.pd_address, 2 << 20), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert parsed == []  # refused at the transport, before any handler
            with pytest.raises(grpc.aio.AioRpcError) as info:  # within the bound: parsed, then refused as a file
                await stub.Encode(_file_request(cluster.pd_address, 512 << 10), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and parsed == [512 << 10]
    finally:
        await encoder.stop(0)


async def test_encoder_limits_image_files_are_decoded_off_the_event_loop(cluster: Cluster) -> None:
    """Security review: decoding and checking an image file must not run on the event loop."""
    loop_thread = threading.get_ident()
    threads: list[int] = []

    def process_file(data: bytes, *_salt):
        threads.append(threading.get_ident())
        raise ValueError("not an image")

    vision = replace(fake_loaded_vision(cluster.vision), process_file=process_file)
    encoder = await start_encoder(TEST_CONFIG, vision=vision)
    try:
        async with grpc_utils.aio_channel(f"127.0.0.1:{encoder.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await epd_pb2_grpc.EncoderStub(channel).Encode(_file_request(cluster.pd_address, 1024), timeout=10)
    finally:
        await encoder.stop(0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(threads) == 1 and threads[0] != loop_thread


async def test_a_stuck_vision_forward_turns_readiness_then_liveness_off_until_it_moves() -> None:
    """Security review: the encoder had no stall watchdog. A forward that never ended left it
    SERVING on both health names while every Encode waited; the proxy and ``epd up`` saw nothing."""
    pd_server, _ = await start_fake_pd()
    vision = FakeVision()
    config = dataclasses.replace(TEST_CONFIG, stall_timeout_s=0.2, liveness_timeout_s=0.5)
    encoder = await start_encoder(config, vision=fake_loaded_vision(vision))
    address, channel = f"127.0.0.1:{encoder.port}", grpc_utils.aio_channel(f"127.0.0.1:{encoder.port}")
    try:
        vision.gate.clear()
        vision.entered.clear()
        call = epd_pb2_grpc.EncoderStub(channel).Encode(encode_request(f"127.0.0.1:{pd_server.port}", 1.0), timeout=20)
        assert await asyncio.to_thread(vision.entered.wait, 5)
        await _until(lambda: grpc_utils.check_health(address, "epd.v1.Encoder"), False)
        assert await grpc_utils.check_health(address, "")  # stuck 0.2 s: routed around, not restarted yet
        await _until(lambda: grpc_utils.check_health(address, ""), False)
        vision.gate.set()  # the forward ends: both come back
        await call
        await _until(lambda: grpc_utils.check_health(address, "epd.v1.Encoder"), True)
        assert await grpc_utils.check_health(address, "")
    finally:
        vision.gate.set()
        await channel.close()
        await encoder.stop(0)
        await pd_server.stop(0)


async def _until(probe, wanted: bool, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while await probe() != wanted:
        assert time.monotonic() < end, f"health never became {wanted}"
        await asyncio.sleep(0.02)


async def test_cache_poisoning_through_an_honest_encoder_by_processed_pixels_is_refused(cluster: Cluster) -> None:
    """First review: PD's embedding cache could be poisoned through an honest encoder. An image file's
    mm_hash is checked against the decoded image; processed pixels cannot be, so by default they are
    refused before any vision work (an Encode naming a popular image's hash with other pixels)."""
    vision = cluster.vision
    encoder = await start_encoder(
        dataclasses.replace(TEST_CONFIG, accept_pixel_values=False), vision=fake_loaded_vision(vision)
    )
    vision.reset_counts()
    try:
        async with grpc_utils.aio_channel(f"127.0.0.1:{encoder.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await epd_pb2_grpc.EncoderStub(channel).Encode(encode_request(cluster.pd_address, 1.0), timeout=10)
    finally:
        await encoder.stop(0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "image_file" in info.value.details()
    assert vision.num_forwards == 0 and cluster.pd.num_calls == 0

"""The embedding hand-off between real encoders and a real PD on loopback, driven by gRPC directly.

Each faulty encoder (``Faults``) drives one of PD's rejection branches; the
tests check the exact status the caller sees, that PD's reservation is left
intact (a good encoder can still fill it), that leases end unfilled
reservations, and that nothing is left reserved, pending or in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import grpc
import pytest
import torch
from cluster_support import InProcessCluster

from services.common import grpc_utils, tensors
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.encoder.config import EncoderConfig
from services.encoder.faults import Faults
from services.encoder.server import load_vision, start_encoder
from services.pd.engine.engine_stats import EngineStats

FAULTS = {
    "good": Faults(),
    "wrong-shape": Faults(wrong_shape=True),
    "wrong-dtype": Faults(wrong_dtype=True),
    "extra-chunk": Faults(extra_chunk=True),
    "late": Faults(push_late_ms=600),
    "never-push": Faults(never_push=True),
}


class Handoff:
    """A PD plus one encoder per fault kind, and gRPC helpers that run on the cluster's loop."""

    def __init__(self, model_dir: str) -> None:
        self.cluster = InProcessCluster(
            model_dir, num_encoders=0, with_proxy=False, pd={"lease_sweep_interval_s": 0.05}
        )
        self.cluster.start()
        self.vision = load_vision(EncoderConfig(model=model_dir, device="cpu"))
        self.encoders = {}
        for name, faults in FAULTS.items():
            config = EncoderConfig(
                model=model_dir,
                device="cpu",
                port=0,
                metrics_port=-1,
                faults=faults,
                grace_s=0,
                accept_pixel_values=True,
            )
            self.encoders[name] = self.cluster.run(start_encoder(config, vision=self.vision))
            self.cluster.encoders.append(self.encoders[name])  # leak checks and stop() cover them
        self.pd_address = self.cluster.pd_addresses[0]

    def pixels(self, seed: int) -> torch.Tensor:
        return self.vision.sample_pixels + torch.randn(
            self.vision.sample_pixels.shape, generator=torch.Generator().manual_seed(seed)
        )

    async def preallocate(self, request_id: str, mm_hash: str, lease_ms: int = 0) -> str:
        n = self.vision.num_tokens
        async with grpc_utils.aio_channel(self.pd_address) as channel:
            reply = await epd_pb2_grpc.PrefillDecodeStub(channel).Preallocate(
                epd_pb2.PreallocateRequest(
                    request_id=request_id,
                    prompt_token_ids=[1] * n,
                    lease_ms=lease_ms,
                    items=[epd_pb2.MultiModalItem(mm_hash=mm_hash, offset=0, num_tokens=n)],
                ),
                timeout=5,
            )
        assert reply.items[0].state == epd_pb2.ItemAllocation.RESERVED
        return reply.items[0].reservation_id

    async def encode(
        self, encoder: str, request_id: str, mm_hash: str, reservation_id: str, seed: int, timeout: float = 10
    ) -> epd_pb2.EncodeResponse:
        request = epd_pb2.EncodeRequest(
            request_id=request_id,
            pd_address=self.pd_address,
            items=[
                epd_pb2.EncodeItem(
                    mm_hash=mm_hash, reservation_id=reservation_id, pixel_values=tensors.to_pb(self.pixels(seed))
                )
            ],
        )
        async with grpc_utils.aio_channel(self.encoders[encoder].address) as channel:
            return await epd_pb2_grpc.EncoderStub(channel).Encode(request, timeout=timeout)

    async def abort(self, request_id: str) -> None:
        async with grpc_utils.aio_channel(self.pd_address) as channel:
            await epd_pb2_grpc.PrefillDecodeStub(channel).Abort(epd_pb2.AbortRequest(request_id=request_id), timeout=5)

    def pd_stats(self) -> EngineStats:
        return self.cluster.run(self.cluster.pds[0].stats())


def mm_hash_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


@pytest.fixture(scope="module")
def handoff(tiny_model_dir):
    handoff = Handoff(str(tiny_model_dir))
    yield handoff
    handoff.cluster.stop()


@pytest.fixture
def h(handoff):
    yield handoff
    assert handoff.cluster.leaks() == {}, "something was left reserved, pending or in flight"


def test_good_push_fills_the_reservation(h: Handoff) -> None:
    mm_hash = mm_hash_of("good")
    rid = h.cluster.run(h.preallocate("req-good", mm_hash))
    reply = h.cluster.run(h.encode("good", "req-good", mm_hash, rid, seed=1))
    assert not reply.items[0].cache_hit
    stats = h.pd_stats()
    assert stats.reserved_tokens == 0 and stats.ready_tokens >= h.vision.num_tokens
    h.cluster.run(h.abort("req-good"))


@pytest.mark.parametrize(
    ("fault", "code"),
    [
        ("wrong-shape", grpc.StatusCode.FAILED_PRECONDITION),  # rows differ from the reservation
        ("extra-chunk", grpc.StatusCode.FAILED_PRECONDITION),  # more bytes than the header declared
        ("wrong-dtype", grpc.StatusCode.INTERNAL),  # PD: INVALID_ARGUMENT, i.e. the encoder's bug
    ],
)
def test_bad_push_is_rejected_and_the_reservation_stays_fillable(h: Handoff, fault: str, code) -> None:
    mm_hash, request_id = mm_hash_of(fault), f"req-{fault}"
    rid = h.cluster.run(h.preallocate(request_id, mm_hash))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        h.cluster.run(h.encode(fault, request_id, mm_hash, rid, seed=2))
    assert info.value.code() == code
    assert h.pd_stats().reserved_tokens == h.vision.num_tokens  # nothing half-filled
    # Retrying the same reservation on a healthy encoder works: PD's state is intact.
    h.cluster.run(h.encode("good", request_id, mm_hash, rid, seed=2))
    assert h.pd_stats().reserved_tokens == 0
    h.cluster.run(h.abort(request_id))


def test_push_after_the_lease_is_rejected(h: Handoff) -> None:
    mm_hash = mm_hash_of("late")
    rid = h.cluster.run(h.preallocate("req-late", mm_hash, lease_ms=150))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        h.cluster.run(h.encode("late", "req-late", mm_hash, rid, seed=3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # a timeout (the proxy's 504), not a 500
    stats = h.pd_stats()
    assert stats.num_reservations == 0 and stats.reserved_tokens == 0


def test_generate_after_the_lease_ran_out_is_a_timeout(h: Handoff) -> None:
    mm_hash = mm_hash_of("slow-generate")
    h.cluster.run(h.preallocate("req-slow", mm_hash, lease_ms=100))
    end = time.monotonic() + 5
    while h.pd_stats().num_reservations:
        assert time.monotonic() < end, "the lease never ended the reservation"
        time.sleep(0.02)

    async def generate() -> None:
        n = h.vision.num_tokens
        async with grpc_utils.aio_channel(h.pd_address) as channel:
            call = epd_pb2_grpc.PrefillDecodeStub(channel).Generate(
                epd_pb2.GenerateRequest(
                    request_id="req-slow",
                    prompt_token_ids=[1] * n,
                    mm_items=[epd_pb2.MultiModalItem(mm_hash=mm_hash, offset=0, num_tokens=n)],
                    sampling=epd_pb2.SamplingParams(temperature=0.0, max_tokens=2),
                ),
                timeout=5,
            )
            async for _ in call:
                pass

    with pytest.raises(grpc.aio.AioRpcError) as info:
        h.cluster.run(generate())
    # The proxy answers DEADLINE_EXCEEDED with 504, not with a 500 for a protocol error.
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "lease expired" in (info.value.details() or "")
    assert h.pd_stats().reserved_tokens == 0


def test_never_pushed_reservation_ends_with_its_lease(h: Handoff) -> None:
    mm_hash = mm_hash_of("never")
    rid = h.cluster.run(h.preallocate("req-never", mm_hash, lease_ms=150))
    h.cluster.run(h.encode("never-push", "req-never", mm_hash, rid, seed=4))  # claims success
    assert h.pd_stats().num_reservations == 1
    end = time.monotonic() + 5
    while h.pd_stats().num_reservations:
        assert time.monotonic() < end, "the lease never ended the reservation"
        time.sleep(0.02)
    assert h.pd_stats().reserved_tokens == 0


def test_encode_is_idempotent_per_reservation(h: Handoff) -> None:
    mm_hash = mm_hash_of("twice")
    rid = h.cluster.run(h.preallocate("req-twice", mm_hash))
    first = h.cluster.run(h.encode("good", "req-twice", mm_hash, rid, seed=5))
    # A retry of the same call (e.g. its reply was lost) succeeds without a second push.
    again = h.cluster.run(h.encode("good", "req-twice", mm_hash, rid, seed=5))
    assert not first.items[0].cache_hit and again.items[0].cache_hit
    h.cluster.run(h.abort("req-twice"))


def test_cancelled_encode_stops_its_push(h: Handoff) -> None:
    mm_hash = mm_hash_of("cancel")
    rid = h.cluster.run(h.preallocate("req-cancel", mm_hash))
    late = h.encoders["late"]

    async def start_then_cancel() -> None:
        call = asyncio.ensure_future(h.encode("late", "req-cancel", mm_hash, rid, seed=6))
        end = time.monotonic() + 5
        while late.stats().outbound_bytes == 0:  # the push is waiting, holding its bytes
            assert time.monotonic() < end
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    h.cluster.run(start_then_cancel())
    end = time.monotonic() + 5
    while late.stats().outbound_bytes:
        assert time.monotonic() < end
        time.sleep(0.01)
    time.sleep(0.7)  # past the fault's delay: a push that was not stopped would land now
    assert h.pd_stats().reserved_tokens == h.vision.num_tokens  # still unfilled
    h.cluster.run(h.abort("req-cancel"))

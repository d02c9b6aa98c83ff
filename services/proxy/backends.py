"""gRPC clients for the PD and encoder pools, and the routing policies over them.

One long-lived channel per instance. Every call carries the request id in
metadata and the request's remaining deadline as its gRPC timeout. Routing
policies are chosen when ``Backends`` is built, never per call.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import grpc_utils
from services.common.pb import epd_pb2, epd_pb2_grpc

PD_SERVICE = "epd.v1.PrefillDecode"
ENCODER_SERVICE = "epd.v1.Encoder"
ABORT_TIMEOUT_S = 5.0
"""Abort is cleanup: it gets its own short timeout, not the (maybe spent) request deadline."""


def _metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((grpc_utils.REQUEST_ID_KEY, request_id),)


class Instance:
    """One backend process: its channel, the proxy's in-flight count, and a cooldown mark.

    ``num_outstanding`` counts this proxy's requests on the instance (a
    least-outstanding router needs no extra RPC). ``down_until`` is set after
    UNAVAILABLE so routers try the instance last for a while (a one-state
    circuit breaker: it still gets traffic when nothing else is left).
    """

    service_name = ""

    def __init__(self, address: str, channel: grpc.aio.Channel, clock: Callable[[], float] = time.monotonic) -> None:
        self.address = address
        self.channel = channel
        self.num_outstanding = 0
        self.down_until = 0.0
        self._clock = clock

    def mark_down(self, cooldown_s: float) -> None:
        self.down_until = self._clock() + cooldown_s

    def is_down(self) -> bool:
        return self._clock() < self.down_until

    async def is_ready(self, timeout: float) -> bool:
        """grpc.health.v1 readiness of the instance's service, over the long-lived channel."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=self.service_name), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address})"


class PdClient(Instance):
    """Client of one PD (``epd.v1.PrefillDecode``)."""

    service_name = PD_SERVICE

    def __init__(self, address: str, channel: grpc.aio.Channel, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(address, channel, clock)
        self.stub = epd_pb2_grpc.PrefillDecodeStub(channel)

    async def preallocate(
        self, request: epd_pb2.PreallocateRequest, *, timeout: float
    ) -> epd_pb2.PreallocateResponse:
        return await self.stub.Preallocate(request, timeout=timeout, metadata=_metadata(request.request_id))

    def generate(self, request: epd_pb2.GenerateRequest, *, timeout: float) -> grpc.aio.UnaryStreamCall:
        """Starts the Generate stream; read it with ``call.read()``, stop it with ``call.cancel()``."""
        return self.stub.Generate(request, timeout=timeout, metadata=_metadata(request.request_id))

    async def abort(self, request_id: str) -> None:
        """Idempotent cancel on PD; failures are swallowed (the lease sweep is the backstop)."""
        try:
            await self.stub.Abort(
                epd_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S, metadata=_metadata(request_id)
            )
        except grpc.aio.AioRpcError:
            pass


class EncoderClient(Instance):
    """Client of one encoder (``epd.v1.Encoder``)."""

    service_name = ENCODER_SERVICE

    def __init__(self, address: str, channel: grpc.aio.Channel, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(address, channel, clock)
        self.stub = epd_pb2_grpc.EncoderStub(channel)

    async def encode(self, request: epd_pb2.EncodeRequest, *, timeout: float) -> epd_pb2.EncodeResponse:
        return await self.stub.Encode(request, timeout=timeout, metadata=_metadata(request.request_id))


class LeastOutstandingRouter:
    """PD policy: fewest in-flight requests from this proxy first; instances in cooldown last.

    Ties rotate so equal instances share load instead of the first one
    taking every request.
    """

    def __init__(self, instances: Sequence[PdClient]) -> None:
        self.instances = list(instances)
        self._rotation = itertools.count()

    def candidates(self) -> list[PdClient]:
        """All instances, best first (the pipeline fails over down this list)."""
        n = len(self.instances)
        start = next(self._rotation) % n
        order = sorted(
            range(n),
            key=lambda i: (self.instances[i].is_down(), self.instances[i].num_outstanding, (i - start) % n),
        )
        return [self.instances[i] for i in order]


class RendezvousRouter:
    """Encoder policy: highest-random-weight hashing on ``mm_hash`` (cache affinity).

    A repeated image lands on the encoder that has it cached; adding or
    removing an encoder only moves the images that hashed to it. Instances
    in cooldown go last, so a dead encoder's images fail over to their
    second choice.
    """

    def __init__(self, instances: Sequence[EncoderClient]) -> None:
        self.instances = list(instances)

    @staticmethod
    def _weight(address: str, mm_hash: str) -> int:
        digest = hashlib.blake2b(f"{address}\0{mm_hash}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    def rank(self, mm_hash: str) -> list[EncoderClient]:
        return sorted(self.instances, key=lambda e: (e.is_down(), -self._weight(e.address, mm_hash)))


class RoundRobinRouter:
    """Encoder policy without affinity: rotate through the instances (cooldown ones last)."""

    def __init__(self, instances: Sequence[EncoderClient]) -> None:
        self.instances = list(instances)
        self._rotation = itertools.count()

    def rank(self, mm_hash: str) -> list[EncoderClient]:
        start = next(self._rotation) % len(self.instances)
        rotated = self.instances[start:] + self.instances[:start]
        return sorted(rotated, key=lambda e: e.is_down())  # stable: keeps the rotation among equals


ENCODER_ROUTERS = {"rendezvous": RendezvousRouter, "round_robin": RoundRobinRouter}


class Backends:
    """The PD and encoder pools with their routers; owns the channels it opened."""

    def __init__(
        self,
        pds: Sequence[PdClient],
        encoders: Sequence[EncoderClient],
        *,
        encoder_routing: str = "rendezvous",
        cooldown_s: float = 2.0,
    ) -> None:
        if not pds:
            raise ValueError("at least one PD is required")
        if encoder_routing not in ENCODER_ROUTERS:
            raise ValueError(f"unknown encoder routing {encoder_routing!r}")
        self.pds = list(pds)
        self.encoders = list(encoders)
        self.pd_router = LeastOutstandingRouter(self.pds)
        self.encoder_router = ENCODER_ROUTERS[encoder_routing](self.encoders)
        self.cooldown_s = cooldown_s

    @classmethod
    def connect(
        cls,
        pd_addresses: Sequence[str],
        encoder_addresses: Sequence[str],
        *,
        encoder_routing: str = "rendezvous",
        cooldown_s: float = 2.0,
    ) -> Backends:
        """Opens one channel per instance (channels connect lazily; nothing blocks here)."""
        pds = [PdClient(a, grpc_utils.aio_channel(a)) for a in pd_addresses]
        encoders = [EncoderClient(a, grpc_utils.aio_channel(a)) for a in encoder_addresses]
        return cls(pds, encoders, encoder_routing=encoder_routing, cooldown_s=cooldown_s)

    async def health(self, timeout: float) -> dict[str, dict[str, bool]]:
        """Readiness of every instance: ``{"pd": {addr: ok}, "encoder": {addr: ok}}``."""
        instances: list[Instance] = [*self.pds, *self.encoders]
        results = await asyncio.gather(*(i.is_ready(timeout) for i in instances))
        report: dict[str, dict[str, bool]] = {"pd": {}, "encoder": {}}
        for instance, ok in zip(instances, results):
            report["pd" if isinstance(instance, PdClient) else "encoder"][instance.address] = ok
        return report

    async def close(self) -> None:
        await asyncio.gather(*(i.channel.close() for i in [*self.pds, *self.encoders]))

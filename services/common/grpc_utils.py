"""gRPC plumbing shared by the services: channel options, channels, servers, health.

Every option key is spelled once, here. Message limits fit the largest
legitimate message: pixel tensors of an Encode call (a few MiB per image)
and 1 MiB push chunks; nothing else comes close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import launch_proof
from services.common.logs import safe_request_id
from services.common.security import NO_SECURITY, InternalSecurity

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest gRPC message accepted or sent (an Encode call with several large images)."""

REQUEST_ID_KEY = "x-request-id"
"""gRPC metadata key that carries the request id across services (for logs)."""

RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata key of a RESOURCE_EXHAUSTED answer: how long to back off."""

FAILED_HOP_KEY = "epd-failed-hop"
"""Trailing metadata key naming the hop that failed when it was not the server's own work."""
PUSH_HOP = "pd-push"
"""``FAILED_HOP_KEY`` value: an encoder's push to PD failed (PD's side or the path to it, not the encoder)."""

KV_PUSH_HOP = "kv-push"
"""``FAILED_HOP_KEY`` value: a prefill instance's KV push to a decode instance failed (the decode side's fault)."""

MISSING_EXTRA_KEY = "epd-missing-extra"
"""Trailing metadata key of a FAILED_PRECONDITION answer refused for want of an optional install: the
name of the pip extra that adds the feature (``structured``: structured outputs on PD)."""

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Fail fast instead of waiting for a dead peer to come back: the proxy
    # retries elsewhere.
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
)


def aio_channel(address: str, security: InternalSecurity = NO_SECURITY) -> grpc.aio.Channel:
    """One long-lived asyncio channel to ``address`` with the shared options.

    ``security`` decides TLS (this process's certificate) and the token attached to every call.
    """
    options = CHANNEL_OPTIONS + security.channel_options()
    interceptors = security.client_interceptors() or None
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def retry_after_ms(error: grpc.aio.AioRpcError) -> int | None:
    """The ``retry-after-ms`` hint of a RESOURCE_EXHAUSTED error, if the server sent one."""
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None


def set_retry_after(context: grpc.aio.ServicerContext, retry_after_ms: int) -> None:
    """Attaches the ``retry-after-ms`` hint to a call about to end RESOURCE_EXHAUSTED."""
    context.set_trailing_metadata(((RETRY_AFTER_KEY, str(max(0, int(retry_after_ms)))),))


def failed_hop(error: grpc.aio.AioRpcError) -> str | None:
    """The ``epd-failed-hop`` trailer of an error (e.g. ``PUSH_HOP``), or None when the server itself failed."""
    for key, value in error.trailing_metadata() or ():
        if key == FAILED_HOP_KEY:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def missing_extra(error: grpc.aio.AioRpcError) -> str | None:
    """The ``epd-missing-extra`` trailer of an error (a pip extra's name), or None."""
    for key, value in error.trailing_metadata() or ():
        if key == MISSING_EXTRA_KEY:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def peer_address(context: grpc.aio.ServicerContext) -> str:
    """The caller's address without its port (``ipv4:10.0.0.7``): one client's connections count as one."""
    peer = context.peer() or ""
    if peer.startswith("ipv6:"):
        return peer.rsplit("]:", 1)[0] + "]" if "]:" in peer else peer
    if peer.startswith("ipv4:"):
        return peer.rsplit(":", 1)[0]
    return peer  # unix sockets and the like: the whole string


def request_id_of(context: grpc.aio.ServicerContext) -> str:
    """The propagated request id of an incoming call, or ``"-"`` (also for one that is not a plain id)."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return safe_request_id(value) or "-"
    return "-"


class _HealthServicer(health.aio.HealthServicer):
    """The stock asyncio health servicer, except that Watch streams end when the server stops,
    and a Check carrying ``epd up``'s challenge is answered with this start's proof.

    A Watch never ends by itself, so without this every ``server.stop(grace)``
    would wait out its whole grace period for the proxies' health watches.
    A watcher sees the stream end (or NOT_SERVING first) and stops routing here.
    ``launch_key``: see ``launch_proof`` (None: no proof is ever given).
    """

    def __init__(self, launch_key: str | None = None) -> None:
        super().__init__()
        self._closing = asyncio.Event()
        self._launch_key = launch_key

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if self._launch_key is not None:
            answer = launch_proof.answer(self._launch_key, context.invocation_metadata())
            if answer is not None:
                context.set_trailing_metadata(((launch_proof.PROOF_METADATA_KEY, answer),))
        return await super().Check(request, context)

    def close_watches(self) -> None:
        self._closing.set()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        watch = asyncio.ensure_future(super().Watch(request, context))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait((watch, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            closing.cancel()
            await asyncio.gather(watch, closing, return_exceptions=True)


@dataclass
class GrpcServer:
    """A started asyncio gRPC server with its health servicer.

    ``service_name`` is the fully-qualified service whose health status means
    "ready"; ``""`` always means "alive".
    """

    server: grpc.aio.Server
    health: _HealthServicer
    port: int
    service_name: str

    async def set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(self.service_name, status)

    async def stop(self, grace: float) -> None:
        """Not ready, health watches ended, then stop: calls in flight get up to ``grace`` seconds.

        New calls are refused (UNAVAILABLE) from here on; it returns as soon as
        the calls in flight are done.
        """
        await self.set_ready(False)
        self.health.close_watches()
        await self.server.stop(grace)


async def start_server(
    host: str,
    port: int,
    service_name: str,
    register: Callable[[grpc.aio.Server], None],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    security: InternalSecurity = NO_SECURITY,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
) -> GrpcServer:
    """Creates, binds and starts a server; ready status starts NOT_SERVING.

    ``port=0`` binds an ephemeral port (tests); the bound port is returned.
    ``security`` adds TLS / mTLS, the token check (outermost, before
    ``interceptors``) and, when asked for, server reflection.
    ``max_receive_bytes``: the largest message this server's methods take
    (gRPC refuses bigger ones with RESOURCE_EXHAUSTED before any handler runs).
    """
    options = tuple(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length")
    server = grpc.aio.server(
        options=(*options, ("grpc.max_receive_message_length", max_receive_bytes)),
        interceptors=[*security.server_interceptors(), *interceptors],
    )
    register(server)
    health_servicer = _HealthServicer(security.launch_key)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if security.reflection:
        # Imported only when asked for: reflection is off by default.
        from grpc_reflection.v1alpha import reflection

        names = (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    credentials = security.server_credentials()
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    await server.start()
    log.info("gRPC %s on port %d: internal transport %s", service_name, bound, security.describe())
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return GrpcServer(server=server, health=health_servicer, port=bound, service_name=service_name)


async def check_health(
    address: str,
    service_name: str,
    timeout: float = 2.0,
    security: InternalSecurity = NO_SECURITY,
    launch_key: str | None = None,
) -> bool:
    """True when ``address`` reports SERVING for ``service_name`` (one-shot, own channel).

    Health needs no token, but with mTLS the handshake needs ``security``'s certificate.
    With ``launch_key``, the server must also prove it holds that key (``launch_proof``);
    then no token is sent, whatever ``security`` holds: the listener is not verified yet.
    """
    if launch_key is not None:
        security = dataclasses.replace(security, token=None, metrics_auth=False)
    async with aio_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service_name)
        try:
            if launch_key is not None:
                reply = await proven_check(stub, request, launch_key, timeout)
            else:
                reply = await stub.Check(request, timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return reply is not None and reply.status == health_pb2.HealthCheckResponse.SERVING


async def proven_check(
    stub: health_pb2_grpc.HealthStub, request: health_pb2.HealthCheckRequest, launch_key: str, timeout: float
) -> health_pb2.HealthCheckResponse | None:
    """A health Check that carries a fresh challenge: the reply, or None when the server did not prove
    ``launch_key`` (some other process on the port, whatever it says). ``AioRpcError`` as from any call.
    """
    challenge = launch_proof.new_challenge()
    call = stub.Check(request, timeout=timeout, metadata=((launch_proof.CHALLENGE_METADATA_KEY, challenge),))
    reply = await call
    if not launch_proof.verify(launch_key, challenge, await call.trailing_metadata()):
        return None
    return reply


async def wait_healthy(
    address: str,
    service_name: str,
    timeout: float,
    interval: float = 0.2,
    security: InternalSecurity = NO_SECURITY,
) -> None:
    """Polls health until SERVING; TimeoutError after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await check_health(address, service_name, security=security):
        if loop.time() > end:
            raise TimeoutError(f"{address} not healthy after {timeout:.0f}s")
        await asyncio.sleep(interval)


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Runs ``main(stop_event)`` on a fresh loop; SIGINT/SIGTERM set the event."""
    import signal

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())

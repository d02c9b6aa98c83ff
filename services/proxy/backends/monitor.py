"""Keeps each instance's readiness and load current, in the background.

Readiness comes from a ``grpc.health.v1`` Watch stream on the instance's
own channel: the server pushes every change (NOT_SERVING while warming up or
draining), and a dead process ends the stream at once, so a SIGKILLed
instance is out of rotation within milliseconds, not a polling period. The
stream is re-opened with capped backoff; the first answer of a recovered
instance puts it back. Under ``epd up`` an instance must first prove, on
each newly opened stream, the launch key ``epd up`` gave it
(``services/common/launch_proof.py``): a process that took a restarting
instance's port is never ready, so no call with the token goes to it.

Load comes from polling ``GetLoad`` on ready instances every
``load_interval_s`` (0 = off; routing then uses this proxy's own counts).

With a ``CacheIndex`` (the cache-aware PD policy), each PD's cache events
are followed too: once the PD is ready (its launch key proven: the stream
carries the token), a ``SubscribeCacheEvents`` stream feeds the index. When
the stream ends, breaks, falls behind or skips a sequence number, the PD's
entries are dropped at once and the stream is reopened with capped backoff,
starting from a fresh snapshot. A killed PD's stream ends when its
connection does, so its entries leave with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from services.common import grpc_utils
from services.proxy.backends.cache_index import CacheIndex
from services.proxy.backends.instances import Instance, PdClient, Readiness, serving

log = logging.getLogger(__name__)


class Monitor:
    """One health-watch task and one load-poll task per watched instance."""

    def __init__(
        self,
        *,
        load_interval_s: float = 0.5,
        retry_s: float = 0.2,
        max_retry_s: float = 2.0,
        rpc_timeout_s: float = 2.0,
        cache_index: CacheIndex | None = None,
        on_resync: Callable[[str], None] | None = None,
    ) -> None:
        """``cache_index``: follow every PD's cache events into it; ``on_resync(reason)`` hears each
        stream that ended and is reopened (gap, fell_behind, ended, error)."""
        self.load_interval_s = load_interval_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.rpc_timeout_s = rpc_timeout_s
        self.cache_index = cache_index
        self._on_resync = on_resync or (lambda reason: None)
        self._tasks: dict[int, list[asyncio.Task]] = {}

    def watch(self, instance: Instance) -> None:
        tasks = [asyncio.create_task(self._watch_health(instance), name=f"health {instance.address}")]
        if self.load_interval_s > 0:
            tasks.append(asyncio.create_task(self._poll_load(instance), name=f"load {instance.address}"))
        if self.cache_index is not None and isinstance(instance, PdClient):
            tasks.append(asyncio.create_task(self._follow_cache(instance), name=f"cache events {instance.address}"))
        self._tasks[id(instance)] = tasks

    async def unwatch(self, instance: Instance) -> None:
        await _cancel(self._tasks.pop(id(instance), []))
        if self.cache_index is not None:
            self.cache_index.drop(instance.address)

    async def close(self) -> None:
        tasks = [t for group in self._tasks.values() for t in group]
        self._tasks.clear()
        await _cancel(tasks)

    async def _watch_health(self, instance: Instance) -> None:
        request = health_pb2.HealthCheckRequest(service=instance.service_name)
        backoff = self.retry_s
        while True:
            proven = instance.launch_key is None
            watch = instance.health_stub.Watch(request)
            try:
                async for reply in watch:
                    # The stream lives on one connection: proving the listener once per stream covers
                    # every answer on it; a new connection means a new stream, proven again.
                    if not proven and not (proven := await self._proven(instance, request)):
                        break
                    instance.set_readiness(serving(reply))
                    backoff = self.retry_s
            except grpc.aio.AioRpcError:
                pass
            finally:
                watch.cancel()
            # The stream ended: the process is gone, stopping, or unreachable.
            instance.set_readiness(Readiness.NOT_READY)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_retry_s)

    async def _proven(self, instance: Instance, request: health_pb2.HealthCheckRequest) -> bool:
        """Whether the listener proves ``instance.launch_key``; logged when it does not."""
        assert instance.launch_key is not None
        try:
            reply = await grpc_utils.proven_check(
                instance.health_stub, request, instance.launch_key, self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        if reply is None:
            log.warning(
                "%s %s: the listener did not prove the launch key epd up gave this instance; not routing to it",
                instance.kind,
                instance.address,
            )
        return reply is not None

    async def _poll_load(self, instance: Instance) -> None:
        while True:
            await asyncio.sleep(self.load_interval_s)
            if instance.readiness is not Readiness.READY:
                continue
            try:
                instance.set_load(await instance.get_load(self.rpc_timeout_s))
            except grpc.aio.AioRpcError as error:
                log.debug("%s %s: GetLoad failed (%s)", instance.kind, instance.address, error.code().name)

    async def _follow_cache(self, instance: PdClient) -> None:
        """Feeds ``instance``'s cache events into the index for as long as it is watched."""
        index = self.cache_index
        assert index is not None
        backoff = self.retry_s
        while True:
            if instance.readiness is not Readiness.READY:  # not before it proved its launch key
                await asyncio.sleep(self.retry_s)
                continue
            reason = "ended"
            call = instance.subscribe_cache_events()
            index.begin(instance.address)
            try:
                async for message in call:
                    if not index.apply(instance.address, message):
                        reason = "gap"
                        break
                    backoff = self.retry_s
            except grpc.aio.AioRpcError as error:
                code = error.code()
                reason = "fell_behind" if code == grpc.StatusCode.RESOURCE_EXHAUSTED else "error"
                if code == grpc.StatusCode.UNIMPLEMENTED:  # a PD without the RPC: routing sees no cache there
                    backoff = self.max_retry_s
                log.debug("pd %s: cache events ended (%s)", instance.address, code.name)
            finally:
                call.cancel()
                index.drop(instance.address)
            self._on_resync(reason)
            if reason == "gap":
                log.info("pd %s: cache events skipped a sequence number; resubscribing", instance.address)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_retry_s)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def wait_known(instances: list[Instance], timeout: float) -> None:
    """Waits (at most ``timeout``) until every instance's readiness is known."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while any(i.readiness is Readiness.UNKNOWN for i in instances) and loop.time() < end:
        await asyncio.sleep(0.01)

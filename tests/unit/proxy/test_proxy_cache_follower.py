"""The monitor follows each PD's cache events into the index: only once the PD is ready, afresh after a gap,
a slow-subscriber drop or an end, and a PD's entries go the moment its stream does."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.pb import epd_pb2
from services.proxy.backends.cache_index import CacheIndex
from services.proxy.backends.instances import Readiness
from services.proxy.backends.monitor import Monitor

ADDRESS = "10.0.0.9:1"


class Stream:
    """A SubscribeCacheEvents call: yields its messages, then ends (or raises ``error``), or waits forever."""

    def __init__(self, messages, *, error: grpc.StatusCode | None = None, hang: bool = False) -> None:
        self.messages, self.error, self.hang = list(messages), error, hang
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for message in self.messages:
            yield message
            await asyncio.sleep(0)
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata())
        while self.hang:
            await asyncio.sleep(0.01)


class FakePd:
    def __init__(self, streams) -> None:
        self.address = ADDRESS
        self.readiness = Readiness.UNKNOWN
        self.streams = list(streams)
        self.opened: list[Stream] = []

    def subscribe_cache_events(self) -> Stream:
        stream = self.streams.pop(0) if self.streams else Stream([], hang=True)
        self.opened.append(stream)
        return stream


def message(sequence: int, *, snapshot: bool = False, keys=(), instance: str = "boot") -> epd_pb2.CacheEvents:
    return epd_pb2.CacheEvents(
        instance_id=instance, block_size=16, sequence=sequence, snapshot=snapshot, blocks_stored=list(keys)
    )


async def wait_until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.fixture
def follow():
    """Runs the follower of a fake PD; yields (start, index, resync reasons)."""
    tasks = []
    reasons: list[str] = []
    index = CacheIndex()
    monitor = Monitor(retry_s=0.01, max_retry_s=0.02, cache_index=index, on_resync=reasons.append)

    def start(pd: FakePd) -> None:
        tasks.append(asyncio.ensure_future(monitor._follow_cache(pd)))  # type: ignore[arg-type]

    yield start, index, reasons
    for task in tasks:
        task.cancel()


async def test_nothing_is_subscribed_before_the_pd_is_ready_then_events_fill_the_index(follow):
    start, index, reasons = follow
    pd = FakePd([Stream([message(3, snapshot=True, keys=[b"a" * 32]), message(4, keys=[b"b" * 32])], hang=True)])
    start(pd)
    await asyncio.sleep(0.05)
    assert pd.opened == []  # the token goes only to a PD whose health (and launch key) checked out
    pd.readiness = Readiness.READY
    await wait_until(lambda: index.sizes() == {ADDRESS: 2})
    assert reasons == []


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        (Stream([message(3, snapshot=True, keys=[b"a" * 32]), message(5)], hang=True), "gap"),
        (
            Stream([message(3, snapshot=True, keys=[b"a" * 32])], error=grpc.StatusCode.RESOURCE_EXHAUSTED),
            "fell_behind",
        ),
        (Stream([message(3, snapshot=True, keys=[b"a" * 32])], error=grpc.StatusCode.UNAVAILABLE), "error"),
        (Stream([message(3, snapshot=True, keys=[b"a" * 32])]), "ended"),
    ],
)
async def test_a_broken_stream_drops_the_pd_and_resubscribes_from_a_snapshot(follow, stream, reason):
    start, index, reasons = follow
    fresh = Stream([message(9, snapshot=True, keys=[b"c" * 32], instance="boot-2")], hang=True)
    pd = FakePd([stream, fresh])
    pd.readiness = Readiness.READY
    start(pd)
    await wait_until(lambda: len(pd.opened) == 2 and index.instance_id(ADDRESS) == "boot-2")
    assert reasons == [reason] and stream.cancelled
    assert index.sizes() == {ADDRESS: 1}  # the new instance's snapshot only


async def test_a_pd_whose_stream_ends_leaves_the_index_at_once(follow):
    start, index, _ = follow
    ended = asyncio.Event()

    class Dies(Stream):
        async def _iterate(self):
            yield message(1, snapshot=True, keys=[b"a" * 32])
            await ended.wait()
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())

    pd = FakePd(
        [Dies([]), Stream([], error=grpc.StatusCode.UNAVAILABLE)] + [Stream([], error=grpc.StatusCode.UNAVAILABLE)] * 50
    )
    pd.readiness = Readiness.READY
    start(pd)
    await wait_until(lambda: index.sizes() == {ADDRESS: 1})
    ended.set()
    await wait_until(lambda: ADDRESS not in index.sizes(), timeout=0.5)

"""SubscribeCacheEvents' feed (services/pd/cache_feed.py) over the real engine thread: a snapshot, then
numbered batches; slow subscribers are dropped, subscribers bounded, drain ends every stream."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from core_support import FakeClock, make_core

from services.common.prefix_keys import prompt_block_keys
from services.pd import cache_feed
from services.pd.bridge import EngineBridge
from services.pd.cache_feed import CacheFeed
from services.pd.engine.cache_events import CacheChanges
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.outputs import Finished
from services.pd.engine.request import Request, SamplingParams

BS = 4


@pytest.fixture
def bridge():
    bridge = EngineBridge(make_core(clock=FakeClock(), num_blocks=64, block_size=BS))
    yield bridge
    bridge.shutdown()


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0))


async def _generate(bridge: EngineBridge, request: Request) -> None:
    events = await bridge.add_request(request)
    while not isinstance(await events.get(), Finished):
        pass


async def test_a_stream_starts_with_a_snapshot_then_numbered_batches(bridge):
    feed = CacheFeed(bridge)
    bridge.start()
    first, second = list(range(1, 14)), list(range(50, 63))
    await _generate(bridge, _request("before", first))  # cached before anyone subscribed: in the snapshot
    async with contextlib.aclosing(feed.stream()) as stream:
        snapshot = await anext(stream)
        assert snapshot.snapshot and snapshot.block_size == BS and snapshot.instance_id == feed.instance_id
        assert list(snapshot.blocks_stored) == prompt_block_keys(first, [], BS)
        await _generate(bridge, _request("after", second))
        batch = await anext(stream)
        assert not batch.snapshot and batch.sequence == snapshot.sequence + 1
        assert list(batch.blocks_stored) == prompt_block_keys(second, [], BS)
        assert batch.unix_time_ms > 0 and feed.num_subscribers == 1
    assert feed.num_subscribers == 0


async def test_a_subscriber_that_falls_behind_is_ended_and_others_go_on(bridge, monkeypatch):
    monkeypatch.setattr(cache_feed, "QUEUE_BATCHES", 3)
    feed = CacheFeed(bridge)
    bridge.start()
    slow, fast = feed.stream(), feed.stream()
    start = (await anext(slow)).sequence
    assert (await anext(fast)).sequence == start
    changes = CacheChanges(blocks_stored=(b"k" * 32,))
    for sequence in range(start + 1, start + 5):  # one more batch than the slow one's queue holds
        feed._fan_out(sequence, changes, 0)
        assert (await anext(fast)).sequence == sequence
    with pytest.raises(EngineError) as raised:
        await anext(slow)
    assert raised.value.kind is ErrorKind.RESOURCE_EXHAUSTED and feed.num_lagged == 1
    await fast.aclose()
    assert feed.num_subscribers == 0


async def test_batches_before_a_snapshot_are_not_sent_again(bridge):
    feed = CacheFeed(bridge)
    bridge.start()
    stream = feed.stream()
    start = (await anext(stream)).sequence
    feed._fan_out(start, CacheChanges(blocks_stored=(b"old" * 8,)), 0)  # already in the snapshot
    feed._fan_out(start + 1, CacheChanges(blocks_stored=(b"new" * 8,)), 0)
    assert list((await anext(stream)).blocks_stored) == [b"new" * 8]
    await stream.aclose()


async def test_subscribers_are_bounded_and_drain_ends_every_stream(bridge):
    feed = CacheFeed(bridge, max_subscribers=2)
    bridge.start()
    streams = [feed.stream(), feed.stream()]
    for stream in streams:
        await anext(stream)
    with pytest.raises(EngineError) as raised:
        await anext(feed.stream())
    assert raised.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    feed.close()
    for stream in streams:
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
    with pytest.raises(EngineError) as raised:
        await anext(feed.stream())
    assert raised.value.kind is ErrorKind.UNAVAILABLE


async def test_a_large_snapshot_is_split_into_messages():
    snapshot = cache_feed.CacheSnapshot(
        BS, tuple(i.to_bytes(32, "big") for i in range(cache_feed.SNAPSHOT_CHUNK + 1)), (("a" * 64, 3),)
    )
    messages = cache_feed.snapshot_to_pb(snapshot, 7, "id")
    assert [len(m.blocks_stored) for m in messages] == [cache_feed.SNAPSHOT_CHUNK, 1]
    assert [len(m.embeddings_stored) for m in messages] == [1, 0]
    assert all(m.snapshot and m.sequence == 7 for m in messages)
    empty = cache_feed.snapshot_to_pb(cache_feed.CacheSnapshot(BS, (), ()), 0, "id")
    assert len(empty) == 1 and empty[0].snapshot


async def test_the_engine_thread_only_numbers_batches_while_nobody_listens(bridge):
    feed = CacheFeed(bridge)
    bridge.start()
    await anext(stream := feed.stream())  # recording is on from the first snapshot
    await stream.aclose()
    await _generate(bridge, _request("unheard", list(range(1, 14))))
    await asyncio.sleep(0.05)
    stream = feed.stream()
    snapshot = await anext(stream)
    assert snapshot.sequence >= 1  # the unheard batch was numbered, and is in this snapshot
    assert set(prompt_block_keys(list(range(1, 14)), [], BS)) <= set(snapshot.blocks_stored)
    await stream.aclose()

"""``SubscribeCacheEvents``: PD's cache changes streamed to the proxies that route by them.

The engine core records what its prefix cache and embedding cache gain and
lose (``engine/cache_events.py``). After every engine-loop iteration the
engine thread takes that batch, numbers it (``sequence``, one per batch for
the whole process) and hands it to the event loop in one
``call_soon_threadsafe``; nothing on the engine thread waits for a
subscriber. The event loop puts it in each subscriber's bounded queue. A
subscriber whose queue is full has fallen behind: its queue is dropped and
its stream ended with RESOURCE_EXHAUSTED, and it resubscribes.

A stream starts with a snapshot taken on the engine thread, after the
pending batch was published to the others: the snapshot reflects every batch
up to its sequence number and none after, so the subscriber applies the
batches numbered above it and a gap is never legitimate. Subscribers are
bounded (``--max-cache-subscribers``); drain (``close``) ends every stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from services.common.pb import epd_pb2
from services.pd.bridge import EngineBridge
from services.pd.config import DEFAULT_MAX_CACHE_SUBSCRIBERS
from services.pd.engine.cache_events import CacheChanges, CacheSnapshot
from services.pd.engine.errors import EngineError, ErrorKind

log = logging.getLogger(__name__)

QUEUE_BATCHES = 1024
"""Batches a subscriber may have unread before it counts as fallen behind (one per engine-loop iteration)."""
SNAPSHOT_CHUNK = 8192
"""Keys (or embeddings) per snapshot message: 8192 keys are ~300 KiB, far below gRPC's 4 MiB default."""

_LAGGED = object()  # queue sentinels: the subscriber fell behind / the feed closed
_CLOSED = object()


@dataclass(eq=False)
class _Subscriber:
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(QUEUE_BATCHES))
    lagged: bool = False


class CacheFeed:
    """Fans the engine's cache changes out to the open ``SubscribeCacheEvents`` streams."""

    def __init__(self, engine: EngineBridge, *, max_subscribers: int = DEFAULT_MAX_CACHE_SUBSCRIBERS) -> None:
        self.engine = engine
        self.max_subscribers = max_subscribers
        self.instance_id = uuid.uuid4().hex  # a restart is another instance
        self._subscribers: set[_Subscriber] = set()
        self._sequence = 0  # engine thread only: the last batch's number
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.num_lagged = 0  # subscribers dropped for falling behind (for tests and logs)
        engine.add_loop_hook(self._publish_pending)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    async def stream(self) -> AsyncGenerator[epd_pb2.CacheEvents, None]:
        """A snapshot, then every later batch; raises EngineError when refused or fallen behind."""
        if self._closed:
            raise EngineError(ErrorKind.UNAVAILABLE, "this instance is shutting down")
        if len(self._subscribers) >= self.max_subscribers:
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "too many cache-event subscribers", 1.0)
        self._loop = asyncio.get_running_loop()
        subscriber = _Subscriber()
        self._subscribers.add(subscriber)  # before the snapshot: batches after it must reach the queue
        try:
            snapshot, start = await self.engine.call(self._snapshot)
            for message in snapshot_to_pb(snapshot, start, self.instance_id):
                yield message
            while True:
                item = await subscriber.queue.get()
                if item is _CLOSED:
                    return
                if item is _LAGGED:
                    raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "cache-event subscriber fell behind; resubscribe")
                sequence, changes, sent_ms = item
                if sequence > start:  # older ones are in the snapshot
                    yield changes_to_pb(changes, sequence, self.instance_id, snapshot.block_size, sent_ms)
        finally:
            self._subscribers.discard(subscriber)

    def close(self) -> None:
        """Ends every stream (drain) and refuses new ones."""
        self._closed = True
        for subscriber in self._subscribers:
            _replace_queue(subscriber, _CLOSED)

    # -- engine thread ---------------------------------------------------------
    def _snapshot(self) -> tuple[CacheSnapshot, int]:
        self._publish_pending()
        return self.engine.core.cache_snapshot(), self._sequence

    def _publish_pending(self) -> None:
        """Numbers the batch of this loop iteration and hands it to the event loop (nothing else here)."""
        changes = self.engine.core.take_cache_changes()
        if changes is None:
            return
        self._sequence += 1
        loop = self._loop
        if loop is not None and self._subscribers:
            try:
                loop.call_soon_threadsafe(self._fan_out, self._sequence, changes, int(time.time() * 1000))
            except RuntimeError:  # the loop closed (shutdown): nobody listens any more
                pass

    # -- event loop -----------------------------------------------------------
    def _fan_out(self, sequence: int, changes: CacheChanges, sent_ms: int) -> None:
        for subscriber in self._subscribers:
            if subscriber.lagged:
                continue
            try:
                subscriber.queue.put_nowait((sequence, changes, sent_ms))
            except asyncio.QueueFull:
                subscriber.lagged = True
                self.num_lagged += 1
                log.warning("a cache-event subscriber fell %d batches behind; ending its stream", QUEUE_BATCHES)
                _replace_queue(subscriber, _LAGGED)


def _replace_queue(subscriber: _Subscriber, sentinel: object) -> None:
    """Drops what the subscriber has not read and leaves it ``sentinel`` alone."""
    queue = subscriber.queue
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(sentinel)


def snapshot_to_pb(snapshot: CacheSnapshot, sequence: int, instance_id: str) -> list[epd_pb2.CacheEvents]:
    """A snapshot as ``CacheEvents`` messages of at most ``SNAPSHOT_CHUNK`` keys and embeddings each (at least one)."""
    keys, embeddings = snapshot.block_keys, snapshot.embeddings
    now = int(time.time() * 1000)
    messages = []
    for start in range(0, max(len(keys), len(embeddings), 1), SNAPSHOT_CHUNK):
        messages.append(
            epd_pb2.CacheEvents(
                instance_id=instance_id,
                block_size=snapshot.block_size,
                sequence=sequence,
                snapshot=True,
                blocks_stored=keys[start : start + SNAPSHOT_CHUNK],
                embeddings_stored=[
                    epd_pb2.CachedEmbedding(mm_hash=h, num_tokens=n)
                    for h, n in embeddings[start : start + SNAPSHOT_CHUNK]
                ],
                unix_time_ms=now,
            )
        )
    return messages


def changes_to_pb(
    changes: CacheChanges, sequence: int, instance_id: str, block_size: int, sent_ms: int
) -> epd_pb2.CacheEvents:
    """One batch of changes as its ``CacheEvents`` message."""
    return epd_pb2.CacheEvents(
        instance_id=instance_id,
        block_size=block_size,
        sequence=sequence,
        blocks_stored=changes.blocks_stored,
        blocks_removed=changes.blocks_removed,
        embeddings_stored=[epd_pb2.CachedEmbedding(mm_hash=h, num_tokens=n) for h, n in changes.embeddings_stored],
        embeddings_removed=changes.embeddings_removed,
        unix_time_ms=sent_ms,
    )

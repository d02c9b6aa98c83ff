"""The proxy's index of what each PD's caches hold (services/proxy/backends/cache_index.py): built from cache
events only, resynchronised on a gap or a restart, bounded in memory."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from services.common.pb import epd_pb2
from services.proxy.backends.cache_index import ENTRY_BYTES, CacheHit, CacheIndex, PromptImage, RoutedPrompt

BS = 4
A, B = "10.0.0.1:1", "10.0.0.2:1"
IMAGE = PromptImage("f" * 64, offset=2, num_tokens=8)


def snapshot(keys=(), embeddings=(), sequence=5, instance="boot-1", block_size=BS) -> epd_pb2.CacheEvents:
    return epd_pb2.CacheEvents(
        instance_id=instance,
        block_size=block_size,
        sequence=sequence,
        snapshot=True,
        blocks_stored=list(keys),
        embeddings_stored=[epd_pb2.CachedEmbedding(mm_hash=h, num_tokens=n) for h, n in embeddings],
    )


def batch(sequence, stored=(), removed=(), embeddings=(), evicted=(), instance="boot-1", sent_ms=0):
    return epd_pb2.CacheEvents(
        instance_id=instance,
        block_size=BS,
        sequence=sequence,
        blocks_stored=list(stored),
        blocks_removed=list(removed),
        embeddings_stored=[epd_pb2.CachedEmbedding(mm_hash=h, num_tokens=n) for h, n in embeddings],
        embeddings_removed=list(evicted),
        unix_time_ms=sent_ms,
    )


def conversation(num_tokens: int = 21) -> RoutedPrompt:
    return RoutedPrompt(list(range(100, 100 + num_tokens)), (IMAGE,))


def test_a_pd_holds_what_its_events_say_and_nothing_else():
    index = CacheIndex()
    prompt = conversation()  # 21 tokens: 5 keyable blocks (the last token's block never is)
    keys = prompt.keys(BS)
    assert len(keys) == 5
    assert index.hit(A, prompt) == CacheHit()  # never subscribed
    index.begin(A)
    assert index.apply(A, snapshot(keys[:2]))
    assert index.hit(A, prompt) == CacheHit(prefix_tokens=8)  # the image (2..10) reaches past the prefix
    assert index.apply(A, batch(6, stored=keys[2:4], embeddings=[(IMAGE.mm_hash, 8)]))
    assert index.hit(A, prompt) == CacheHit(prefix_tokens=16)  # the image is inside the prefix now
    assert index.apply(A, batch(7, removed=[keys[1]]))
    # A chain stops at its first missing block (PD's own lookup); the image's embedding is still held.
    assert index.hit(A, prompt) == CacheHit(prefix_tokens=4, embedding_tokens=8)
    assert index.apply(A, batch(8, evicted=[IMAGE.mm_hash]))
    assert index.hit(A, prompt).tokens == 4
    assert index.hit(B, prompt) == CacheHit()
    assert index.sizes() == {A: 3} and index.num_bytes == 3 * ENTRY_BYTES


def test_a_gap_another_instance_or_a_late_snapshot_is_refused():
    index = CacheIndex()
    assert not index.apply(A, batch(1))  # no stream begun
    index.begin(A)
    assert not index.apply(A, batch(6))  # a change before any snapshot
    assert index.apply(A, snapshot([b"a" * 32], sequence=5))
    assert index.apply(A, snapshot([b"b" * 32], sequence=5))  # a snapshot may take several messages
    assert not index.apply(A, snapshot(sequence=4))  # ... all of one sequence number
    assert not index.apply(A, batch(7, stored=[b"c" * 32]))  # 6 is missing
    assert not index.apply(A, batch(6, instance="boot-2"))  # a restarted PD's batch on this stream
    assert index.apply(A, batch(6))
    assert not index.apply(A, snapshot(sequence=6))  # a snapshot after changes
    assert index.instance_id(A) == "boot-1" and index.sizes() == {A: 2}
    index.begin(A)  # the follower resubscribes: the entry starts afresh
    assert index.sizes() == {A: 0}
    index.drop(A)
    index.drop(A)
    assert index.sizes() == {} and index.instance_id(A) is None


def test_batches_report_their_lag():
    lags = []
    index = CacheIndex(on_lag=lags.append, wall_clock=lambda: 100.0)
    index.begin(A)
    index.apply(A, snapshot(sequence=0))
    index.apply(A, batch(1, sent_ms=99_750))
    index.apply(A, batch(2))  # no time stamp: nothing to report
    assert lags == [pytest.approx(0.25)]


def test_the_least_recently_stored_or_matched_entries_go_first():
    index = CacheIndex(max_bytes=6 * ENTRY_BYTES)
    prompt = conversation()
    keys = prompt.keys(BS)
    index.begin(A)
    index.apply(A, snapshot(keys[:3]))
    index.apply(A, batch(6, stored=[b"x" * 32, b"y" * 32]))
    assert index.hit(A, prompt).prefix_tokens == 12  # matching the prompt's blocks makes them recent
    index.apply(A, batch(7, stored=[b"z" * 32, b"w" * 32]))  # 7 entries: one must go, x (the oldest)
    assert index.sizes() == {A: 6} and index.hit(A, prompt).prefix_tokens == 12
    index.begin(B)  # two PDs share the bound: A keeps its 3 most recent, the blocks just matched
    assert index.sizes() == {A: 3, B: 0}
    assert index.hit(A, prompt).prefix_tokens == 12
    index.apply(A, batch(8, stored=[b"v" * 32]))  # now the least recent of them goes
    assert index.hit(A, prompt).prefix_tokens == 0
    with pytest.raises(ValueError):
        CacheIndex(max_bytes=ENTRY_BYTES - 1)


def test_the_index_stays_within_its_memory_bound_under_100k_distinct_prefixes():
    max_bytes = 8 << 20
    index = CacheIndex(max_bytes=max_bytes)
    index.begin(A)
    index.apply(A, snapshot(sequence=0))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for sequence, start in enumerate(
            range(0, 100_000, 500), start=1
        ):  # 100k distinct prompts, 4 blocks and an image each
            stored, embeddings = [], []
            for n in range(start, start + 500):
                stored += [(4 * n + i).to_bytes(32, "big") for i in range(4)]  # distinct 32-byte keys
                embeddings.append((f"{n:064x}", 576))
            assert index.apply(A, batch(sequence, stored=stored, embeddings=embeddings))
            held = tracemalloc.get_traced_memory()[0] - base
            assert held <= max_bytes, f"{held} bytes after {start + 500} prefixes"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.num_entries == index.max_entries  # full: 500k entries came, the most recent stayed
    assert index.num_bytes <= max_bytes
    assert peak - base <= max_bytes * 1.25  # a batch's own messages come on top while it is applied

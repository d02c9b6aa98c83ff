"""EmbeddingCache: two-step allocation, pushes, references, leases and LRU eviction."""

from __future__ import annotations

import pytest

from services.pd.engine.embedding_cache import EmbeddingCache
from services.pd.engine.embedding_records import (
    AlreadyFilled,
    EmbeddingCacheFull,
    EntryState,
    ReservationNotFound,
    ReservationRejected,
)

RESERVED, READY = EntryState.RESERVED, EntryState.READY
LEASE = 10.0


@pytest.fixture
def evicted():
    return []


class RecordingCache(EmbeddingCache):
    """The real cache, whose ``preallocate`` answers its items and records what it
    evicted in ``evicted`` (the list the engine core frees tensors from)."""

    def __init__(self, evicted: list[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.evicted = evicted

    def preallocate(self, *args, **kwargs):
        result = super().preallocate(*args, **kwargs)
        self.evicted += result.evicted
        return result.items


@pytest.fixture
def cache(evicted):
    c = RecordingCache(evicted, capacity_tokens=100, retry_after_s=0.5)
    yield c
    c.check_integrity()


def reserve(cache, request_id, mm_hash, num_tokens=10, now=0.0):
    [(h, state, rid)] = cache.preallocate(request_id, [(mm_hash, num_tokens)], now + LEASE, now)
    return state, rid


def make_ready(cache, request_id, mm_hash, num_tokens=10):
    """Reserve, push and take over, then release: a cached, unreferenced entry."""
    state, rid = reserve(cache, request_id, mm_hash, num_tokens)
    assert state is RESERVED
    assert cache.fill(request_id, rid, mm_hash, now=1.0)
    assert cache.take_over(request_id) == [mm_hash]
    cache.release(mm_hash)


def test_reserve_fill_take_over_release(cache):
    state, rid = reserve(cache, "r1", "h1")
    assert state is RESERVED and not cache.is_ready("h1")
    assert cache.stats().reserved_tokens == 10
    cache.check_push("r1", rid, "h1", 10, now=1.0)
    assert cache.fill("r1", rid, "h1", now=1.0) is True
    assert cache.is_ready("h1") and cache.stats().ready_tokens == 10
    assert cache.stats().evictable_tokens == 0  # the filled reservation pins it
    assert cache.take_over("r1") == ["h1"]
    assert cache.ref_count("h1") == 1 and cache.stats().num_reservations == 0
    cache.release("h1")
    cache.release("h1")  # extra release is a no-op
    assert cache.ref_count("h1") == 0 and cache.stats().evictable_tokens == 10


def test_awaits_push_while_an_entry_is_reserved(cache):
    """What a PD beside an encoder asks before each step (services/pd/shared_cores.py)."""
    assert not cache.awaits_push()
    state, rid = reserve(cache, "r1", "h1")
    assert cache.awaits_push()
    assert cache.take_over("r1") == ["h1"]  # Generate came first: the push is still awaited
    assert cache.awaits_push()
    cache.fill("r1", rid, "h1", now=1.0)
    assert not cache.awaits_push()
    reserve(cache, "r2", "h2")
    cache.cancel_request("r2")
    assert not cache.awaits_push()


def test_ready_entry_is_pinned_then_taken_over(cache, evicted):
    make_ready(cache, "r0", "h1")
    [(h, state, rid)] = cache.preallocate("r1", [("h1", 10)], LEASE, 0.0)
    assert state is READY and cache.stats().evictable_tokens == 0
    with pytest.raises(ReservationRejected, match="pin"):
        cache.check_push("r1", rid, "h1", 10, now=1.0)
    with pytest.raises(EmbeddingCacheFull):  # the pinned entry is not evictable
        cache.preallocate("r2", [("h2", 95)], LEASE, 0.0)
    assert cache.take_over("r1") == ["h1"] and cache.ref_count("h1") == 1
    with pytest.raises(EmbeddingCacheFull):  # referenced: still not evictable
        cache.preallocate("r2", [("h2", 95)], LEASE, 0.0)
    cache.release("h1")
    reserve(cache, "r2", "h2", 95)
    assert evicted == ["h1"] and cache.state("h1") is None


def test_join_pending_entry_and_duplicate_push(cache):
    _, rid1 = reserve(cache, "r1", "h1")
    state, rid2 = reserve(cache, "r2", "h1")
    assert state is RESERVED and rid2 != rid1
    assert cache.stats().used_tokens == 10  # joined: no extra room
    assert cache.fill("r2", rid2, "h1", now=1.0) is True
    assert cache.fill("r1", rid1, "h1", now=1.0) is False  # accepted and dropped
    with pytest.raises(ReservationRejected, match="already filled"):
        cache.check_push("r1", rid1, "h1", 10, now=1.0)
    assert cache.take_over("r1") == ["h1"] and cache.take_over("r2") == ["h1"]
    assert cache.ref_count("h1") == 2
    cache.release("h1")
    cache.release("h1")


def test_preallocate_is_all_or_nothing(cache):
    make_ready(cache, "r0", "old", 30)
    reserve(cache, "r1", "busy", 40)
    before = cache.stats()
    with pytest.raises(EmbeddingCacheFull) as info:
        cache.preallocate("r2", [("a", 20), ("b", 20), ("old", 30)], LEASE, 0.0)
    assert info.value.retry_after_s == 0.5
    assert cache.stats() == before and cache.state("a") is None
    answers = cache.preallocate("r2", [("a", 20), ("a", 20), ("old", 30)], LEASE, 0.0)
    assert [(h, s) for h, s, _ in answers] == [("a", RESERVED), ("a", RESERVED), ("old", READY)]
    assert answers[0][2] == answers[1][2]  # one reservation per distinct image
    assert cache.stats().used_tokens == 90


def test_invalid_preallocations(cache):
    reserve(cache, "r1", "h1", 10)
    with pytest.raises(ValueError):
        cache.preallocate("r2", [("h1", 11)], LEASE, 0.0)  # size differs from the entry
    with pytest.raises(ValueError):
        cache.preallocate("r2", [("h2", 5), ("h2", 6)], LEASE, 0.0)
    with pytest.raises(ValueError):
        cache.preallocate("r2", [("h2", 101)], LEASE, 0.0)  # can never fit
    with pytest.raises(ValueError):
        cache.preallocate("r2", [("h2", 5)], 0.0, 0.0)  # lease already over
    assert cache.stats().num_reservations == 1


def test_evictable_rows_count_as_room(cache, evicted):
    make_ready(cache, "r0", "h1", 60)
    reserve(cache, "r1", "h2", 30)  # 10 free + 60 evictable
    with pytest.raises(EmbeddingCacheFull):
        cache.preallocate("r2", [("h3", 71)], LEASE, 0.0)
    assert evicted == []
    reserve(cache, "r2", "h3", 70)
    assert evicted == ["h1"]


def test_push_validation(cache):
    _, rid = reserve(cache, "r1", "h1", 10)
    with pytest.raises(ReservationNotFound):
        cache.check_push("r1", "nope", "h1", 10, now=1.0)
    with pytest.raises(ReservationRejected):
        cache.check_push("r2", rid, "h1", 10, now=1.0)  # another request
    with pytest.raises(ReservationRejected):
        cache.check_push("r1", rid, "h2", 10, now=1.0)  # another image
    with pytest.raises(ReservationRejected, match="size"):
        cache.check_push("r1", rid, "h1", 9, now=1.0)
    with pytest.raises(ReservationRejected, match="expired"):
        cache.check_push("r1", rid, "h1", 10, now=LEASE + 1)  # lease over, not yet swept
    with pytest.raises(ReservationRejected):
        cache.fill("r1", rid, "h1", now=LEASE + 1)
    assert cache.state("h1") is RESERVED


def test_cancel_frees_room_and_late_push_is_rejected(cache):
    _, rid = reserve(cache, "r1", "h1", 10)
    assert cache.cancel_request("r1") == ["h1"]
    assert cache.state("h1") is None and cache.stats().used_tokens == 0
    with pytest.raises(ReservationRejected, match="cancelled"):
        cache.check_push("r1", rid, "h1", 10, now=1.0)
    assert cache.cancel_request("r1") == []


def test_a_late_push_to_a_served_request_is_taken_as_a_repeat(cache):
    # E+P+D's prefill half can finish from the prefix cache before the encoder's push lands.
    _, rid = reserve(cache, "r1", "h1", 10)
    assert cache.cancel_request("r1", served=True) == ["h1"]
    assert cache.state("h1") is None and cache.stats().used_tokens == 0
    with pytest.raises(AlreadyFilled):
        cache.check_push("r1", rid, "h1", 10, now=1.0)  # not wanted: the push succeeds, its bytes are dropped
    with pytest.raises(ReservationRejected, match="size"):
        cache.check_push("r1", rid, "h1", 9, now=1.0)
    with pytest.raises(ReservationRejected):
        cache.check_push("r2", rid, "h1", 10, now=1.0)  # another request's push to it is still refused


def test_cancel_keeps_the_last_push_others_wait_on(cache):
    _, rid = reserve(cache, "r1", "h1", 10)
    assert cache.acquire("h1")  # someone else waits on the pending entry
    assert cache.cancel_request("r1") == []
    assert cache.state("h1") is RESERVED
    assert cache.fill("r1", rid, "h1", now=1.0) is True  # the push still lands
    assert cache.stats().num_reservations == 0  # and the orphaned reservation ends
    cache.release("h1")


def test_a_late_push_for_a_request_served_by_another_push_is_a_repeat(cache):
    """E+P+D burst: r2 joined r1's pending entry, r1's push made it READY, r2 prefilled from it and
    ended (a prefill instance ends a request at its first token); r2's own push arrives after that."""
    _, rid1 = reserve(cache, "r1", "h1")
    _, rid2 = reserve(cache, "r2", "h1")
    assert cache.take_over("r2") == ["h1"]  # Generate waits on the pending entry
    assert cache.fill("r1", rid1, "h1", now=1.0) is True
    cache.release("h1")
    cache.cancel_request("r2")  # r2 ended, served
    with pytest.raises(AlreadyFilled):  # acknowledged, nothing stored; a size mismatch is still refused
        cache.check_push("r2", rid2, "h1", 10, now=2.0)
    with pytest.raises(ReservationRejected, match="size"):
        cache.check_push("r2", rid2, "h1", 9, now=2.0)
    with pytest.raises(ReservationRejected, match="served"):  # another request's id is no repeat
        cache.check_push("r3", rid2, "h1", 10, now=2.0)
    assert cache.take_over("r1") == ["h1"]
    cache.release("h1")


def test_a_push_for_a_request_that_ended_unserved_is_still_rejected(cache):
    _, rid1 = reserve(cache, "r1", "h1")
    _, rid2 = reserve(cache, "r2", "h1")
    assert cache.fill("r1", rid1, "h1", now=1.0) is True
    cache.cancel_request("r2")  # aborted before its Generate took the reservation over
    with pytest.raises(ReservationRejected, match="cancelled"):
        cache.check_push("r2", rid2, "h1", 10, now=2.0)
    cache.cancel_request("r1")


def test_expire_drops_pending_entries_and_unpins_ready_ones(cache):
    _, rid_pending = reserve(cache, "r1", "pending", 10, now=0.0)
    make_ready(cache, "r0", "ready", 10)
    reserve(cache, "r2", "ready", 10, now=5.0)  # a pin, lease ends at 15
    result = cache.expire(now=12.0)
    assert [r.reservation_id for r in result.expired] == [rid_pending]
    assert result.dropped_hashes == ["pending"] and cache.state("pending") is None
    assert cache.stats().evictable_tokens == 0
    result = cache.expire(now=16.0)
    assert result.dropped_hashes == [] and cache.is_ready("ready")
    assert cache.stats().evictable_tokens == 10
    with pytest.raises(ReservationRejected, match="expired"):
        cache.check_push("r1", rid_pending, "pending", 10, now=16.0)


def test_filled_push_without_generate_is_unpinned_by_its_lease(cache):
    _, rid = reserve(cache, "r1", "h1")
    cache.fill("r1", rid, "h1", now=1.0)
    assert cache.stats().evictable_tokens == 0
    assert cache.expire(now=LEASE + 1).dropped_hashes == []
    assert cache.is_ready("h1") and cache.stats().evictable_tokens == 10


def test_taken_over_push_stays_live_until_filled(cache):
    _, rid = reserve(cache, "r1", "h1")
    assert cache.take_over("r1") == ["h1"]
    assert cache.take_over("r1") == []  # no second reference
    assert cache.ref_count("h1") == 1 and cache.state("h1") is RESERVED
    assert cache.fill("r1", rid, "h1", now=1.0)
    assert cache.stats().num_reservations == 0 and cache.ref_count("h1") == 1
    cache.release("h1")


def test_taken_over_push_that_expires_drops_the_entry_even_if_referenced(cache):
    reserve(cache, "r1", "h1")
    cache.take_over("r1")
    result = cache.expire(now=LEASE + 1)
    assert result.dropped_hashes == ["h1"] and cache.state("h1") is None
    cache.release("h1")  # dangling release: no-op
    assert cache.stats().used_tokens == 0


def test_lru_eviction_order_and_callback(cache, evicted):
    for h in ("a", "b", "c"):
        make_ready(cache, "r-" + h, h, 30)
    assert cache.acquire("a")  # touch a: b is now the oldest
    cache.release("a")
    reserve(cache, "r1", "d", 40)  # needs 30 more: evicts b only
    assert evicted == ["b"]
    reserve(cache, "r2", "e", 50)  # evicts c, then a
    assert evicted == ["b", "c", "a"]


def test_never_evicts_referenced_reserved_or_pinned(cache):
    make_ready(cache, "r0", "ref", 20)
    assert cache.acquire("ref")
    make_ready(cache, "r0b", "pinned", 20)
    reserve(cache, "r1", "pinned", 20)  # pin
    reserve(cache, "r2", "pending", 20)
    make_ready(cache, "r3", "free", 20)
    with pytest.raises(EmbeddingCacheFull):
        cache.preallocate("r4", [("x", 41)], LEASE, 0.0)
    reserve(cache, "r4", "x", 40)  # only "free" could go
    assert cache.state("free") is None
    assert all(cache.state(h) is not None for h in ("ref", "pinned", "pending"))
    cache.release("ref")


def test_acquire_absent_and_pending(cache):
    assert not cache.acquire("nope")
    reserve(cache, "r1", "h1")
    assert cache.acquire("h1") and cache.ref_count("h1") == 1
    cache.release("h1")
    cache.cancel_request("r1")


def test_integrity_check_detects_corruption(cache):
    reserve(cache, "r1", "h1")
    cache._used_tokens += 1  # simulate a bookkeeping bug
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache._used_tokens -= 1

"""Finding 3: a token holder's flood of Preallocates (unbounded; lease expiry O(N^2) on the engine thread).

Requests that hold room from a Preallocate before their Generate are bounded
in total and per caller address, and every path that ends the hold gives
the room back; lease expiry pops only the leases that ended.
"""

from __future__ import annotations

import pytest
from core_support import EmbeddingDouble, FakeClock, RunnerDouble, make_core

from services.pd.engine.embedding_cache import EmbeddingCache
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.preallocated import Preallocated, PreallocatedRequests, PreallocationLimits
from services.pd.engine.request import MultiModalSpan, Request, SamplingParams

IMG = 0
LEASE_S = 10.0
PROMPT = [1, 2, 3, 4] + [IMG] * 8 + [5, 6, 7, 8, 9]


def core(max_total: int = 3, max_per_peer: int = 2):
    clock = FakeClock(100.0)
    engine = make_core(
        clock=clock,
        num_blocks=64,
        block_size=4,
        embedding_tokens=256,
        max_model_len=64,
        max_num_batched_tokens=64,
        runner=RunnerDouble(),
        preallocation_limits=PreallocationLimits(max_total, max_per_peer),
    )
    return engine, clock


def preallocate(engine, request_id: str, peer: str, image: str = "a"):
    return engine.preallocate(request_id, [MultiModalSpan(f"h-{image}-{request_id}", 4, 8)], LEASE_S, PROMPT, peer)


def refused(engine, request_id: str, peer: str) -> EngineError:
    with pytest.raises(EngineError) as raised:
        preallocate(engine, request_id, peer)
    return raised.value


def test_preallocates_are_bounded_per_caller_and_in_total():
    engine, _ = core(max_total=3, max_per_peer=2)
    preallocate(engine, "a1", "ipv4:10.0.0.1")
    preallocate(engine, "a2", "ipv4:10.0.0.1")
    error = refused(engine, "a3", "ipv4:10.0.0.1")  # this caller's share is spent
    assert error.kind is ErrorKind.RESOURCE_EXHAUSTED and error.retry_after_s and "preallocated" in error.message
    preallocate(engine, "b1", "ipv4:10.0.0.2")
    assert refused(engine, "b2", "ipv4:10.0.0.2").kind is ErrorKind.RESOURCE_EXHAUSTED  # the total is spent
    assert engine.stats().num_reservations == 3  # the refused calls reserved nothing
    engine.check_integrity()


def test_every_end_of_a_hold_gives_its_room_back():
    engine, clock = core(max_total=2, max_per_peer=2)
    peer = "ipv4:10.0.0.1"
    first = preallocate(engine, "gen", peer)
    preallocate(engine, "gone", peer)
    refused(engine, "x", peer)
    # Generate takes the first over: its room is the request's now.
    engine.fill("gen", first[0].reservation_id, first[0].mm_hash, EmbeddingDouble(8))
    spans = [MultiModalSpan(first[0].mm_hash, 4, 8)]
    engine.add_request(Request("gen", list(PROMPT), SamplingParams(max_tokens=1), mm_spans=spans))
    preallocate(engine, "y", peer)
    # An abort of a preallocated request ends its hold.
    engine.abort("gone")
    preallocate(engine, "z", peer)
    refused(engine, "w", peer)
    # Leases that run out end theirs.
    clock.now += LEASE_S + 1
    engine.sweep()
    preallocate(engine, "v", peer)
    preallocate(engine, "u", peer)
    engine.check_integrity()


class _NoScan(dict):
    """A dict whose values may not be walked: expiry must not look at live leases (test double)."""

    def values(self):
        raise AssertionError("lease expiry walked every live lease")


def test_lease_expiry_pops_only_the_leases_that_ended():
    pending = PreallocatedRequests()
    pending._pending = _NoScan()
    for i in range(1000):
        probe = Request(f"r{i}", [1, 2], SamplingParams())
        pending.add(Preallocated(probe, deadline=1000.0 + i, covers_images=False))
    assert [p.probe.request_id for p in pending.expire(1002.5)] == ["r0", "r1", "r2"]
    assert pending.expire(1002.5) == []
    pending.pop("r3")  # taken over early: its stale heap entry is skipped
    assert [p.probe.request_id for p in pending.expire(1005.5)] == ["r4", "r5"]

    cache = EmbeddingCache(100_000)
    for i in range(1000):
        cache.preallocate(f"r{i}", [(f"h{i}", 4)], lease_deadline=1000.0 + i, now=0.0)
    book = cache._reservations  # the ReservationBook: its open reservations may not be walked
    book._open = _NoScan(book._open)
    assert sorted(r.request_id for r in cache.expire(1001.5).expired) == ["r0", "r1"]
    cache.cancel_request("r2")
    assert [r.request_id for r in cache.expire(1003.5).expired] == ["r3"]

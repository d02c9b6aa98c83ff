"""The image hand-off in the engine core: Preallocate answers, KV pins, take-over, leases (no model, no torch).

Preallocate may answer READY for an image because its KV is in the prefix
cache, even when the embedding itself is long gone; those KV blocks are pinned
until the request is admitted or its lease ends.
"""

from __future__ import annotations

import pytest
from core_support import EmbeddingDouble, FakeClock, RunnerDouble, make_core

from services.pd.engine import preallocated as preallocated_module
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.outputs import Failed, Finished, SchedulerOutput
from services.pd.engine.preallocated import PreallocatedRequests
from services.pd.engine.request import MultiModalSpan, Request, RequestStatus, SamplingParams

IMG = 0
LEASE_S = 10.0
PROMPT = [1, 2, 3, 4] + [IMG] * 8 + [5, 6, 7, 8, 9]  # image at 4..11, 17 tokens


class Harness:
    """The real engine core over real caches; a runner double samples token 7."""

    def __init__(self, *, num_blocks=16, embedding_tokens=16, prefix_caching=True, max_waiting_requests=8):
        self.clock = FakeClock(100.0)
        self.core = make_core(
            clock=self.clock,
            num_blocks=num_blocks,
            block_size=4,
            embedding_tokens=embedding_tokens,
            prefix_caching=prefix_caching,
            max_model_len=64,
            max_num_batched_tokens=64,
            max_waiting_requests=max_waiting_requests,
            runner=RunnerDouble(),
        )
        self.sched, self.kv, self.emb = self.core.scheduler, self.core.kv_cache, self.core.embedding_cache

    @property
    def store(self) -> dict:
        """White-box: the core's embedding tensors by mm_hash."""
        return self.core._embeddings

    @property
    def num_kv_leases(self) -> int:
        return self.core.stats().num_kv_leases

    def preallocate(self, request_id, spans, prompt=PROMPT):
        return self.core.preallocate(request_id, [MultiModalSpan(*s) for s in spans], LEASE_S, prompt)

    def push(self, request_id, allocation, rows=8):
        self.core.fill(request_id, allocation.reservation_id, allocation.mm_hash, EmbeddingDouble(rows))

    def generate(self, request_id, spans, prompt=PROMPT, max_tokens=2) -> Request:
        request = Request(
            request_id,
            list(prompt),
            SamplingParams(max_tokens=max_tokens),
            mm_spans=[MultiModalSpan(*s) for s in spans],
        )
        self.core.add_request(request)
        return request

    def step(self) -> tuple[SchedulerOutput, list[str]]:
        self.sched.last_output = SchedulerOutput()
        result = self.core.step()
        self.check()
        ended = [r for r, e in result.events if isinstance(e, (Finished, Failed))]
        return self.sched.last_output, ended

    def run(self):
        for _ in range(50):
            if not self.core.has_work():
                return
            self.step()
        raise AssertionError("did not finish")

    def check(self):
        self.core.check_integrity()

    def serve(self, request_id, mm_hash, prompt=PROMPT) -> Request:
        """Preallocate, push, generate and finish one request with one image at 4..11."""
        [allocation] = self.preallocate(request_id, [(mm_hash, 4, 8)], prompt)
        if not allocation.ready:
            self.push(request_id, allocation)
        request = self.generate(request_id, [(mm_hash, 4, 8)], prompt)
        self.run()
        return request

    def evict_embeddings(self):
        """Fill the embedding cache with another image so every READY entry goes."""
        [filler] = self.preallocate(
            "filler", [("filler", 0, self.emb.capacity_tokens)], prompt=[IMG] * self.emb.capacity_tokens + [1]
        )
        self.core.abort("filler")
        assert filler.ready is False and not self.store


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.check()
    assert harness.kv.num_pinned_blocks == 0 and harness.num_kv_leases == 0


def test_reserved_pushed_taken_over_and_released(h):
    [allocation] = h.preallocate("a", [("cat", 4, 8)])
    assert not allocation.ready and not allocation.via_prefix_cache
    h.push("a", allocation)
    assert "cat" in h.store
    request = h.generate("a", [("cat", 4, 8)])
    assert request.span_refs == {0} and h.emb.ref_count("cat") == 1
    h.run()
    assert request.status is RequestStatus.FINISHED_LENGTH and h.emb.ref_count("cat") == 0


def test_ready_from_prefix_cache_after_the_embedding_was_evicted(h):
    first = h.serve("a", "cat")
    h.evict_embeddings()
    [allocation] = h.preallocate("b", [("cat", 4, 8)])
    assert allocation.ready and allocation.via_prefix_cache
    assert h.emb.state("cat") is None and h.kv.num_pinned_blocks == 3  # blocks 0..2 cover 0..11
    # Traffic that wants every free block cannot evict the pinned prefix.
    hog = h.generate("hog", [], prompt=list(range(100, 100 + 4 * h.kv.num_free_blocks)), max_tokens=1)
    h.step()
    assert hog.is_finished
    request = h.generate("b", [("cat", 4, 8)])
    assert request.span_refs == set()  # no embedding needed at all
    out, _ = h.step()
    [chunk] = out.chunks
    # The pinned blocks (through the image) survived the hog; block 3 did not.
    assert chunk.start_pos == 12 and chunk.image_slices == []
    # The pin stays until the request ends: a preemption could not recompute the image without it.
    assert request.num_cached_tokens == 12 and h.kv.num_pinned_blocks == 3
    h.run()
    assert request.output_token_ids == first.output_token_ids and h.kv.num_pinned_blocks == 0


def test_another_image_at_the_same_position_is_not_ready(h):
    h.serve("a", "cat")
    [allocation] = h.preallocate("b", [("dog", 4, 8)])
    assert not allocation.ready and h.kv.num_pinned_blocks == 0
    h.core.abort("b")


def test_partial_coverage_pins_the_first_image_and_reserves_the_second(h):
    prompt = PROMPT + [IMG] * 4 + [10]  # second image at 17..20
    h.serve("a", "cat", prompt=prompt[:17] + [11, 12, 13, 14, 15])
    answers = h.preallocate("b", [("cat", 4, 8), ("dog", 17, 4)], prompt=prompt)
    assert [a.ready for a in answers] == [True, False]
    assert answers[0].via_prefix_cache and h.kv.num_pinned_blocks == 3
    h.push("b", answers[1], rows=4)
    request = h.generate("b", [("cat", 4, 8), ("dog", 17, 4)], prompt=prompt)
    assert request.span_refs == {1}
    h.step()
    assert request.num_cached_tokens == 16 and h.emb.ref_count("dog") == 1  # held until the request ends
    h.run()
    assert h.emb.ref_count("dog") == 0


def test_a_push_to_a_kv_pin_is_rejected(h):
    h.serve("a", "cat")
    h.evict_embeddings()
    [allocation] = h.preallocate("b", [("cat", 4, 8)])
    with pytest.raises(EngineError) as info:
        h.push("b", allocation)
    assert info.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "cat" not in h.store
    h.core.abort("b")
    h.core.abort("b")  # idempotent


def test_kv_pin_lease_expires_then_generate_still_finds_cached_kv(h):
    h.serve("a", "cat")
    h.evict_embeddings()
    h.preallocate("b", [("cat", 4, 8)])
    h.clock.now += LEASE_S + 1
    h.core.sweep()
    assert h.kv.num_pinned_blocks == 0 and h.num_kv_leases == 0
    request = h.generate("b", [("cat", 4, 8)])  # the KV is still cached
    assert request.span_refs == set() and h.kv.num_pinned_blocks == 3
    h.run()


def test_generate_fails_cleanly_when_neither_kv_nor_embedding_is_left(h):
    h.serve("a", "cat")
    h.evict_embeddings()
    h.preallocate("b", [("cat", 4, 8)])
    h.clock.now += LEASE_S + 1
    h.core.sweep()
    hog = h.generate("hog", [], prompt=list(range(100, 100 + 4 * h.kv.num_blocks - 1)), max_tokens=1)
    h.step()  # every block reused: prefix gone
    h.core.abort(hog.request_id)
    with pytest.raises(EngineError) as info:
        h.generate("b", [("cat", 4, 8)])
    assert info.value.kind is ErrorKind.DEADLINE_EXCEEDED  # its lease ran out: a timeout
    assert h.kv.num_pinned_blocks == 0 and h.emb.stats().num_reservations == 0
    with pytest.raises(EngineError) as info:
        h.generate("c", [("cat", 4, 8)])
    assert info.value.kind is ErrorKind.FAILED_PRECONDITION  # never preallocated
    with pytest.raises(EngineError) as info:
        h.generate("b", [("cat", 4, 8)])
    assert info.value.kind is ErrorKind.FAILED_PRECONDITION  # the expiry is reported once


def test_expired_request_ids_are_remembered_within_a_bound(monkeypatch):
    monkeypatch.setattr(preallocated_module, "EXPIRED_MEMORY", 2)
    book = PreallocatedRequests()
    for request_id in ("x", "y", "z"):
        book.remember_expired([request_id])
    assert [book.pop_expired(r) for r in ("x", "y", "z")] == [False, True, True]  # the oldest is forgotten first


def test_refused_generate_gives_back_references_and_pins():
    h = Harness(max_waiting_requests=1)
    h.serve("a", "cat")
    [ready] = h.preallocate("b", [("cat", 4, 8)])  # embedding READY and KV cached
    assert ready.via_prefix_cache
    h.generate("blocker", [], prompt=[1, 2, 3])  # fills the waiting queue
    assert h.kv.num_pinned_blocks == 3
    with pytest.raises(EngineError) as info:
        h.generate("b", [("cat", 4, 8)])
    assert info.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert h.kv.num_pinned_blocks == 0 and h.emb.ref_count("cat") == 0
    h.run()
    h.check()


def test_failed_preallocate_pins_nothing(h):
    h.serve("a", "cat")
    h.preallocate("holder", [("dog", 0, 8)], prompt=[IMG] * 8 + [1])  # 8 of 16 rows, unevictable
    prompt = PROMPT + [IMG] * 16 + [10]
    with pytest.raises(EngineError) as info:
        h.preallocate("b", [("cat", 4, 8), ("huge", 17, 16)], prompt=prompt)
    assert info.value.kind is ErrorKind.RESOURCE_EXHAUSTED and info.value.retry_after_s
    assert h.kv.num_pinned_blocks == 0 and h.num_kv_leases == 0
    with pytest.raises(EngineError) as info:
        h.preallocate("b", [("cat", 4, 8), ("huge", 17, 17)], prompt=prompt + [IMG])  # can never fit
    assert info.value.kind is ErrorKind.INVALID_ARGUMENT
    assert h.kv.num_pinned_blocks == 0
    h.core.abort("holder")


def test_without_prefix_caching_the_embedding_cache_answers():
    h = Harness(prefix_caching=False)
    h.serve("a", "cat")
    [allocation] = h.preallocate("b", [("cat", 4, 8)])
    assert allocation.ready and not allocation.via_prefix_cache  # pinned in the embedding cache
    request = h.generate("b", [("cat", 4, 8)])
    assert request.span_refs == {0}
    h.run()
    assert h.emb.ref_count("cat") == 0

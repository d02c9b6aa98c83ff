"""Scheduler policy, driven through the real engine core with hand-made model outputs (no model, no torch).

The harness builds the production ``EngineCore`` (real scheduler, KV and
embedding caches); a runner double samples the tokens each test dictates and
checks, before every step, that each chunk would attend over exactly the K/V
its request computed itself.
"""

from __future__ import annotations

import random

import pytest
from core_support import EmbeddingDouble, FakeClock, PrefillBudgetDouble, RunnerDouble, make_core

from services.pd.embedding_cache import EntryState
from services.pd.errors import EngineError, ErrorKind
from services.pd.outputs import Failed, Finished, ModelRunnerOutput, SampledToken, SchedulerOutput
from services.pd.request import MultiModalSpan, Request, RequestStatus, SamplingParams
from services.pd.scheduler import QueueFull, SchedulerConfig

EOS = 2
TOKEN = 7          # what the runner double samples unless told otherwise
IMG = 0            # image placeholder token
LEASE = 100.0
IMAGES = "abcdefgh"   # 8 images x 6 rows fit the 64-row embedding cache of the random test


class Harness:
    """The engine core with real caches and scheduler, a fake clock and a runner double."""

    def __init__(self, *, num_blocks=64, block_size=4, budget=16, max_num_seqs=8,
                 max_model_len=256, embedding_tokens=256, prefix_caching=True, **limits):
        self.clock = FakeClock()
        self.runner = RunnerDouble()
        self.runner.on_step = lambda out, embeddings: [self._check_chunk(c) for c in out.chunks]
        self.prefill_budget = PrefillBudgetDouble(budget)
        self.core = make_core(clock=self.clock, runner=self.runner, num_blocks=num_blocks, block_size=block_size,
                              embedding_tokens=embedding_tokens, prefix_caching=prefix_caching,
                              max_model_len=max_model_len, max_num_batched_tokens=budget,
                              max_num_seqs=max_num_seqs, step_budget=self.prefill_budget, **limits)
        self.sched = self.core.scheduler
        self.kv, self.emb = self.core.kv_cache, self.core.embedding_cache
        self.evicted: list[str] = []                  # READY entries a Preallocate evicted, in order
        self.reservations: dict[tuple[str, str], str] = {}
        self.requests: dict[str, Request] = {}
        # Stand-in for the KV tensors: (block, slot) -> what the runner wrote
        # there, a chained digest of the whole prefix up to that position.
        self.fake_kv: dict[tuple[int, int], int] = {}
        self.prefix_digests: dict[str, list[int]] = {}

    def add(self, request_id, prompt, spans=(), max_tokens=4, ready=(), **sampling) -> Request:
        """Preallocate the images, push those in ``ready``, then Generate."""
        spans = [MultiModalSpan(*s) for s in spans]
        if spans:
            before = {h for h in self._known_hashes() if self.emb.is_ready(h)}
            for allocation in self.core.preallocate(request_id, spans, LEASE, list(prompt)):
                self.reservations[(request_id, allocation.mm_hash)] = allocation.reservation_id
            self.evicted += sorted(h for h in before if self.emb.state(h) is None)
        for h in ready:
            self.push(request_id, h)
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling),
                          mm_spans=spans, eos_token_id=EOS)
        self.core.add_request(request)
        self.requests[request_id] = request
        return request

    def push(self, request_id, mm_hash) -> bool:
        """The encoder's PushEmbedding for this request's reservation; False if rejected."""
        rid = self.reservations[(request_id, mm_hash)]
        try:
            self.core.fill(request_id, rid, mm_hash, EmbeddingDouble(self.emb.num_tokens(mm_hash)))
        except EngineError:   # e.g. a READY pin, or the request already ended
            return False
        return True

    def step(self, tokens: dict[str, int] | None = None,
             prefill_budget: int | None = None) -> tuple[SchedulerOutput, list[Request]]:
        """One engine step (prefill chunks within ``prefill_budget``, if given); checks the budgets and
        every invariant. Returns the requests that ended."""
        self.runner.tokens = dict(tokens or {})
        self.prefill_budget.next = prefill_budget
        self.sched.last_output = SchedulerOutput()
        decoding = {r.request_id for r in self.sched.running if r.is_decoding}
        result = self.core.step()
        out = self.sched.last_output
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks)
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        if prefill_budget is not None:
            assert sum(c.num_tokens for c in out.chunks if c.request_id not in decoding) <= prefill_budget
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        self.check()
        self.clock.now += 0.01
        return out, self.ended(result.events)

    def ended(self, events) -> list[Request]:
        """The requests whose last event is among ``events``."""
        return [self.requests[request_id] for request_id, event in events if isinstance(event, (Finished, Failed))]

    def error_of(self, events, request_id) -> EngineError | None:
        return next((e.error for r, e in events if r == request_id and isinstance(e, Failed)), None)

    def _check_chunk(self, chunk) -> None:
        """Oracle of the runner's view: the KV it attends over is exactly what this
        request would have computed itself (prefix hits, block tables, preemption)."""
        request = self.sched.get_request(chunk.request_id)
        end = chunk.start_pos + chunk.num_tokens
        assert chunk.token_ids == request.all_token_ids[chunk.start_pos:end]
        assert len(chunk.block_ids) * self.kv.block_size >= end
        assert chunk.sample == (end == request.num_tokens)
        for image in chunk.image_slices:   # only READY rows are ever spliced in
            assert self.emb.is_ready(image.mm_hash)
        digests = self._prefix_digests(request, end)
        size = self.kv.block_size
        for pos in range(end):
            slot = (chunk.block_ids[pos // size], pos % size)
            if pos < chunk.start_pos:
                assert self.fake_kv.get(slot) == digests[pos], f"stale KV at position {pos}"
            else:
                self.fake_kv[slot] = digests[pos]

    def _prefix_digests(self, request: Request, end: int) -> list[int]:
        digests = self.prefix_digests.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        while len(digests) < end:
            pos = len(digests)
            row = next((f"{s.mm_hash}:{pos - s.offset}" for s in request.mm_spans
                        if s.offset <= pos < s.end), "")
            digests.append(hash((digests[-1] if digests else 0, tokens[pos], row)))
        return digests

    def run(self, max_steps=200) -> list[Request]:
        finished = []
        for _ in range(max_steps):
            if not self.core.has_work():
                return finished
            finished += self.step()[1]
        raise AssertionError("did not finish")

    def check(self) -> None:
        self.core.check_integrity()
        # Every reference in the cache is one held by a request for an uncomputed span.
        held: dict[str, int] = {}
        for request in list(self.sched.running) + list(self.sched.waiting):
            for index in request.span_refs:
                h = request.mm_spans[index].mm_hash
                held[h] = held.get(h, 0) + 1
        for h in set(held) | {h for h in self._known_hashes()}:
            assert self.emb.ref_count(h) == held.get(h, 0), h

    def _known_hashes(self):
        return {h for _, h in self.reservations}


@pytest.fixture
def make():
    """Builds harnesses; each is checked once more when the test ends."""
    made: list[Harness] = []

    def factory(**kwargs) -> Harness:
        made.append(Harness(**kwargs))
        return made[-1]

    yield factory
    for harness in made:
        harness.check()


@pytest.fixture
def h(make):
    return make()


def chunk_of(out, request_id):
    [chunk] = [c for c in out.chunks if c.request_id == request_id]
    return chunk


def test_chunked_prefill_then_decode(make):
    h = make(budget=4)
    request = h.add("a", range(10, 20), max_tokens=3)
    sizes = []
    for _ in range(3):
        out, _ = h.step()
        sizes.append((chunk_of(out, "a").start_pos, chunk_of(out, "a").num_tokens,
                      chunk_of(out, "a").sample))
    assert sizes == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert request.output_token_ids == [TOKEN] and request.timings.first_token is not None
    out, _ = h.step()
    assert chunk_of(out, "a").token_ids == [TOKEN] and chunk_of(out, "a").start_pos == 10
    _, finished = h.step()
    assert finished == [request] and request.status is RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [TOKEN] * 3
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert h.sched.schedule().finished_request_ids == ["a"]


def test_decodes_and_prefill_share_the_budget(make):
    h = make(budget=8)
    h.add("a", range(5), max_tokens=10)
    h.step()                                            # a prefills, samples
    h.add("b", range(100, 130))
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]


def test_max_num_seqs_limits_admission(make):
    h = make(max_num_seqs=2, budget=64)
    for i in range(3):
        h.add(f"r{i}", range(i * 10, i * 10 + 5), max_tokens=2)
    out, _ = h.step()
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert h.sched.num_running == 2 and h.sched.num_waiting == 1
    h.step()                                            # r0, r1 finish (2 tokens)
    out, _ = h.step()
    assert [c.request_id for c in out.chunks] == ["r2"]


def test_a_prefill_budget_caps_prefill_chunks_and_never_decodes(make):
    h = make(budget=16)
    h.add("a", range(5), max_tokens=10)
    h.add("b", range(20, 25), max_tokens=10)
    h.step()                                            # both prefill and sample
    h.add("c", range(100, 130))
    out, _ = h.step(prefill_budget=3)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 3)]
    h.add("d", range(200, 204))
    out, _ = h.step(prefill_budget=0)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1)]
    # Held back by the budget, not blocked on an image; nothing admitted.
    assert h.requests["c"].status is RequestStatus.RUNNING and h.requests["d"].status is RequestStatus.WAITING
    out, _ = h.step()                                   # the step budget alone
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 14)]
    h.run()


def test_a_spent_prefill_share_holds_a_prefilling_request_back(make):
    h = make(budget=64)
    h.add("a", range(10, 22), max_tokens=10)
    h.add("b", [3] * 4 + [IMG] * 6 + [4] * 10, spans=[("x", 4, 6)])   # stops before its image
    h.add("c", range(100, 180))                                         # 80 tokens: a partial chunk
    out, _ = h.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 12), ("b", 4), ("c", 48)]
    h.push("b", "x")
    out, _ = h.step(prefill_budget=5)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 5)]
    assert h.requests["c"].status is RequestStatus.RUNNING
    out, _ = h.step(prefill_budget=40)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 11), ("c", 29)]
    h.run()


def test_text_prefills_while_image_encodes_then_resumes(h):
    prompt = [5, 6, 7, 8, 9, 10] + [IMG] * 8 + [11, 12, 13]
    request = h.add("a", prompt, spans=[("cat", 6, 8)], max_tokens=2)
    out, _ = h.step()
    chunk = chunk_of(out, "a")
    assert (chunk.start_pos, chunk.num_tokens, chunk.sample, chunk.image_slices) == (0, 6, False, [])
    h.clock.now = 1.0
    out, _ = h.step()
    assert out.is_empty and request.status is RequestStatus.WAITING_FOR_EMBEDDING
    h.clock.now = 3.0
    h.push("a", "cat")
    out, _ = h.step()
    chunk = chunk_of(out, "a")
    assert (chunk.start_pos, chunk.num_tokens, chunk.sample) == (6, 11, True)
    [image] = chunk.image_slices
    assert (image.mm_hash, image.src_start, image.dst_start, image.length) == ("cat", 0, 0, 8)
    assert request.status is RequestStatus.RUNNING
    assert request.timings.embedding_wait_s == pytest.approx(2.0)
    assert request.span_refs == set() and h.emb.ref_count("cat") == 0   # in KV: reference dropped
    h.run()
    assert h.emb.is_ready("cat")                        # stays cached for reuse


def test_image_first_request_waits_while_others_go_ahead(h):
    blocked = h.add("img", [IMG] * 4 + [1, 2], spans=[("cat", 0, 4)])
    h.add("txt", [3, 4, 5])
    out, _ = h.step()
    assert [c.request_id for c in out.chunks] == ["txt"]
    assert blocked.status is RequestStatus.WAITING_FOR_EMBEDDING and not blocked.block_ids
    assert list(h.sched.waiting) == [blocked]
    h.push("img", "cat")
    out, _ = h.step()
    assert chunk_of(out, "img").num_tokens == 6
    h.run()


def test_chunk_splits_an_image_span(make):
    h = make(budget=5)
    prompt = [1, 2] + [IMG] * 8 + [3]
    h.add("a", prompt, spans=[("cat", 2, 8)], ready=["cat"])
    slices = []
    for _ in range(3):
        out, _ = h.step()
        slices.append([(s.src_start, s.dst_start, s.length) for s in chunk_of(out, "a").image_slices])
    assert slices == [[(0, 2, 3)], [(3, 0, 5)], []]


def test_two_images_in_one_chunk_and_partial_readiness(make):
    h = make(budget=64)
    prompt = [1] + [IMG] * 3 + [2] + [IMG] * 3 + [3]
    request = h.add("a", prompt, spans=[("x", 1, 3), ("y", 5, 3)], ready=["x"])
    out, _ = h.step()
    assert chunk_of(out, "a").num_tokens == 5             # up to the unready second image
    assert h.emb.ref_count("x") == 0 and h.emb.ref_count("y") == 1
    h.push("a", "y")
    out, _ = h.step()
    assert [(s.mm_hash, s.dst_start) for s in chunk_of(out, "a").image_slices] == [("y", 0)]
    assert request.span_refs == set()
    h.run()


def test_same_image_twice_in_a_prompt(h):
    prompt = [1] + [IMG] * 2 + [2] + [IMG] * 2 + [3]
    h.add("a", prompt, spans=[("x", 1, 2), ("x", 4, 2)], ready=["x"])
    h.check()
    assert h.emb.ref_count("x") == 2
    h.run()
    assert h.emb.ref_count("x") == 0


def test_preempts_newest_and_admits_nothing_in_that_step(make):
    h = make(num_blocks=7, block_size=4, budget=64)
    old = h.add("old", range(8), max_tokens=20)
    new = h.add("new", range(100, 108), max_tokens=20)
    h.step()                                              # 2 blocks each, 3 free
    late = h.add("late", range(200, 205), max_tokens=1)   # needs 2 blocks: no room once both decode
    for _ in range(10):
        out, _ = h.step()
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["new"]
    assert [c.request_id for c in out.chunks] == ["old"]  # no admission in a preempting step ...
    assert h.kv.num_free_blocks >= 2                      # ... although late would fit now
    assert new.status is RequestStatus.PREEMPTED and new.num_preemptions == 1
    assert h.sched.num_preemptions == 1
    assert new.block_ids == [] and new.num_computed_tokens == 0
    assert list(h.sched.waiting) == [new, late] and late.status is RequestStatus.WAITING
    outputs_before = list(new.output_token_ids)
    finished = h.run(max_steps=400)
    assert {r.request_id for r in finished} == {"old", "new", "late"}
    assert new.output_token_ids[:len(outputs_before)] == outputs_before
    assert len(old.output_token_ids) == len(new.output_token_ids) == 20


def test_the_newest_request_preempts_itself_when_it_runs_out(make):
    h = make(num_blocks=4, block_size=4, budget=64)
    a = h.add("a", range(6), max_tokens=2)                # 2 blocks, room up to position 7
    b = h.add("b", range(100, 108), max_tokens=4)         # 2 full blocks
    h.step()
    out, _ = h.step()                                     # b's decode needs a 5th block
    assert out.preempted_request_ids == ["b"] and [c.request_id for c in out.chunks] == ["a"]
    assert b.status is RequestStatus.PREEMPTED
    h.run()
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH
    assert len(b.output_token_ids) == 4


def test_resume_reuses_prefix_cache_even_if_image_was_evicted(make):
    h = make(num_blocks=8, block_size=4, budget=64, embedding_tokens=8)
    prompt = [1, 2, 3, 4] + [IMG] * 8 + [5]
    request = h.add("a", prompt, spans=[("cat", 4, 8)], ready=["cat"], max_tokens=8)
    h.step()
    _force_preempt(h, request)
    h.add("b", [IMG] * 8 + [9], spans=[("dog", 0, 8)], max_tokens=1)   # evicts "cat"
    assert h.evicted == ["cat"]
    out, _ = h.step()
    chunk = chunk_of(out, "a")
    assert chunk.start_pos == 12 and chunk.image_slices == []   # image covered by cached KV
    h.core.abort("b")
    h.run()


def test_resume_fails_retryably_when_image_evicted_and_not_in_kv(make):
    h = make(num_blocks=8, block_size=4, budget=64, embedding_tokens=8, prefix_caching=False)
    prompt = [1, 2, 3, 4] + [IMG] * 8 + [5]
    request = h.add("a", prompt, spans=[("cat", 4, 8)], ready=["cat"], max_tokens=8)
    h.step()
    _force_preempt(h, request)
    h.add("b", [IMG] * 8 + [9], spans=[("dog", 0, 8)], max_tokens=1)
    h.runner.on_step = None
    result = h.core.step()
    out = h.sched.last_output
    assert "a" not in [c.request_id for c in out.chunks]
    assert h.ended(result.events) == [request] and request.status is RequestStatus.FINISHED_ERROR
    error = h.error_of(result.events, "a")
    assert error.kind is ErrorKind.UNAVAILABLE and "no longer cached" in request.error   # retryable elsewhere
    h.core.abort("b")


def _force_preempt(h: Harness, request: Request) -> None:
    out = SchedulerOutput()
    h.sched._preempt(request, out, h.clock.now)
    h.check()


def test_prefix_hit_sets_cached_tokens_and_skips_compute(h):
    a = h.add("a", range(13), max_tokens=1)
    h.run()
    b = h.add("b", list(range(13)) + [50, 51], max_tokens=1)
    out, _ = h.step()
    assert b.num_cached_tokens == 12 and chunk_of(out, "b").start_pos == 12
    assert chunk_of(out, "b").num_tokens == 3
    assert a.num_cached_tokens == 0
    assert h.sched.num_prefix_hit_tokens == 12
    h.run()


def test_prefix_hit_with_images(h):
    prompt = [1, 2] + [IMG] * 8 + [3, 4, 5]
    h.add("a", prompt, spans=[("cat", 2, 8)], ready=["cat"], max_tokens=1)
    h.run()
    other = h.add("b", prompt, spans=[("dog", 2, 8)], ready=["dog"], max_tokens=1)
    same = h.add("c", prompt, spans=[("cat", 2, 8)], max_tokens=1)   # cat is READY: pinned
    out, _ = h.step()
    assert other.num_cached_tokens == 0                   # same tokens, other image: no sharing
    assert same.num_cached_tokens == 12
    assert chunk_of(out, "c").image_slices == []
    assert h.emb.ref_count("cat") == 0                    # span covered by KV: reference dropped
    h.run()


@pytest.mark.parametrize("sampling, tokens, status, num_out", [
    ({}, [TOKEN, EOS], RequestStatus.FINISHED_STOPPED, 2),
    ({"ignore_eos": True}, [EOS, EOS, EOS, EOS], RequestStatus.FINISHED_LENGTH, 4),
    ({"stop_token_ids": (42,)}, [TOKEN, 42], RequestStatus.FINISHED_STOPPED, 2),
    ({}, [TOKEN] * 4, RequestStatus.FINISHED_LENGTH, 4),
])
def test_stop_conditions(h, sampling, tokens, status, num_out):
    request = h.add("a", [1, 2, 3], max_tokens=4, **sampling)
    for token in tokens:
        h.step({"a": token})
    assert request.status is status and len(request.output_token_ids) == num_out


def test_max_model_len_stops_generation(make):
    h = make(max_model_len=6)
    request = h.add("a", [1, 2, 3, 4], max_tokens=100)
    h.run()
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 6


def refusal(h: Harness, request_id, prompt, **kwargs) -> EngineError:
    """The error Generate gets for a request the scheduler refuses (nothing is held after it)."""
    with pytest.raises(EngineError) as info:
        h.add(request_id, prompt, **kwargs)
    return info.value


def test_queue_bounds_and_invalid_requests(make):
    h = make(max_waiting_requests=2, max_waiting_tokens=10, max_model_len=12, num_blocks=4)
    h.add("a", range(3))
    assert refusal(h, "a", range(3)).kind is ErrorKind.ALREADY_EXISTS        # duplicate id
    h.add("b", range(4))
    full = refusal(h, "c", range(1))
    assert full.kind is ErrorKind.RESOURCE_EXHAUSTED and full.retry_after_s == 1.0
    h.step()                                              # both admitted: waiting is empty
    h.add("d", range(7))
    assert refusal(h, "x", range(4)).kind is ErrorKind.RESOURCE_EXHAUSTED   # 7 + 4 waiting tokens > 10
    never = refusal(h, "y", range(11))                    # could never wait here, even alone
    assert never.kind is ErrorKind.INVALID_ARGUMENT and "waiting-queue" in never.message
    assert refusal(h, "e", range(13)).kind is ErrorKind.INVALID_ARGUMENT     # longer than max_model_len
    assert refusal(h, "f", []).kind is ErrorKind.INVALID_ARGUMENT
    bad = Request("h", [1, 2, 3], SamplingParams(), mm_spans=[MultiModalSpan("x", 2, 2)])
    with pytest.raises(ValueError):
        h.sched.add_request(bad)                          # span past the prompt
    with pytest.raises(QueueFull):
        h.sched.check_room(4)
    h.check()
    small = make(num_blocks=2, block_size=4)
    assert refusal(small, "g", range(10), max_tokens=2).kind is ErrorKind.INVALID_ARGUMENT   # 3 blocks of 2


def test_finish_is_idempotent_and_releases_everything(h):
    request = h.add("a", [1, 2] + [IMG] * 4 + [3], spans=[("cat", 2, 4)])
    h.step()                                              # prefills [1, 2], waits for cat
    assert request.block_ids and h.emb.ref_count("cat") == 1
    assert h.core.abort("a") is request
    assert h.core.abort("a") is None
    assert request.status is RequestStatus.FINISHED_ABORTED and not request.block_ids
    assert h.emb.state("cat") is None                     # its unfilled reservation is gone too
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert h.sched.schedule().finished_request_ids == ["a"]
    with pytest.raises(ValueError):
        h.sched.finish_request("a", RequestStatus.RUNNING)


def test_abort_of_a_waiting_request(make):
    h = make(max_num_seqs=1)
    h.add("a", [1, 2, 3], max_tokens=5)
    b = h.add("b", [4, 5, 6])
    h.step()
    assert h.core.abort("b") is b
    assert h.sched.num_waiting == 0
    h.run()


def test_failing_requests_waiting_on_an_expired_image(h):
    a = h.add("a", [1] + [IMG] * 4 + [2], spans=[("cat", 1, 4)])
    b = h.add("b", [IMG] * 4 + [3], spans=[("cat", 0, 4)])
    c = h.add("c", [IMG] * 4 + [3], spans=[("dog", 0, 4)])
    h.step()
    assert h.sched.requests_waiting_on("cat") == [a, b] and h.sched.requests_waiting_on("dog") == [c]
    h.clock.now = LEASE + 1
    h.core.sweep()                                        # both pushes are lost: their entries go
    assert h.emb.state("cat") is None and h.emb.state("dog") is None
    _, failed = h.step()
    assert failed == [a, b, c]
    assert all(r.status is RequestStatus.FINISHED_ERROR for r in failed)
    assert not h.sched.has_unfinished_requests()


def test_missing_embedding_detected_without_engine_help(h):
    request = h.add("a", [1] + [IMG] * 4 + [2], spans=[("cat", 1, 4)])
    h.step()
    h.emb.expire(now=LEASE + 1)                           # dropped; nobody told the scheduler
    out, finished = h.step()
    assert finished == [request] and request.status is RequestStatus.FINISHED_ERROR


def test_update_ignores_chunks_of_requests_finished_meanwhile(h):
    request = h.add("a", [1, 2, 3])
    out = h.sched.schedule()
    h.core.abort("a")                                     # between the schedule and the update
    sampled = {"a": SampledToken(TOKEN)}
    assert h.sched.update_from_output(out, ModelRunnerOutput(sampled)) == []
    assert request.output_token_ids == []


def test_missing_sampled_token_fails_the_request(h):
    request = h.add("a", [1, 2, 3])
    h.runner.omit.add("a")
    _, finished = h.step()
    assert finished == [request]
    assert request.status is RequestStatus.FINISHED_ERROR and request.error == "the model step sampled no token"


def test_config_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(max_model_len=0)
    with pytest.raises(Exception):
        SchedulerConfig(max_model_len=8).max_num_seqs = 2   # frozen


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_invariants(seed, make):
    """Random arrivals, images, pushes, lost pushes, aborts, tight KV and prefill budgets: every
    step keeps the budgets and all invariants, and every request ends with nothing leaked."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    h = make(num_blocks=rng.randint(40, 56) // block_size, block_size=block_size,
                budget=rng.choice([3, 8, 32]), max_num_seqs=rng.randint(1, 6),
                embedding_tokens=64, prefix_caching=rng.random() < 0.8)
    pending: list[tuple[str, str]] = []
    num_added, ended = 0, []
    for _ in range(300):
        if num_added < 25 and rng.random() < 0.4:
            _add_random(h, rng, f"r{num_added}", pending)
            num_added += 1
        if pending and rng.random() < 0.4:
            item = pending.pop(rng.randrange(len(pending)))
            if rng.random() < 0.9:
                h.push(*item)                              # else lost: the encoder failed
        if h.sched.num_running and rng.random() < 0.03:
            victim = rng.choice(h.sched.running)
            h.core.abort(victim.request_id)               # its end arrives with the next step's events
        tokens = {r.request_id: rng.choice([TOKEN, TOKEN, TOKEN, EOS]) for r in h.sched.running}
        ended += h.step(tokens, prefill_budget=rng.choice([None, None, 1, 2, 5]))[1]
    for item in pending:
        h.push(*item)
    # Lost pushes: the lease sweep drops their entries and fails whoever waits on them.
    h.clock.now += LEASE + 1
    h.core.sweep()
    ended += h.run(max_steps=2000)
    assert len(ended) == num_added
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert all(h.emb.ref_count(x) == 0 for x in IMAGES)
    assert h.emb.stats().num_reservations == 0


def _add_random(h: Harness, rng: random.Random, request_id: str, pending: list) -> None:
    prompt, spans = [], []
    for _ in range(rng.randint(0, 2)):
        prompt += [rng.randint(3, 6) for _ in range(rng.randint(0, 5))]
        mm_hash = rng.choice(IMAGES)
        if mm_hash in {s[0] for s in spans}:
            continue
        spans.append((mm_hash, len(prompt), 6))        # every image of a hash has 6 rows
        prompt += [IMG] * 6
    prompt += [rng.randint(3, 6) for _ in range(rng.randint(1, 6))]
    h.add(request_id, prompt, spans=spans, max_tokens=rng.randint(1, 12))
    pending += [(request_id, s[0]) for s in spans
                if h.emb.state(s[0]) is EntryState.RESERVED]

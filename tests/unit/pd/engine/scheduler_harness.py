"""The scheduler tests' harness: the real engine core with a runner double that checks every step.

The harness builds the production ``EngineCore`` (real scheduler, KV and
embedding caches); a runner double samples the tokens each test dictates and
checks, before every step, that each chunk would attend over exactly the K/V
its request computed itself.
"""

from __future__ import annotations

import pytest
from core_support import EmbeddingDouble, FakeClock, PrefillBudgetDouble, RunnerDouble, make_core

from services.pd.engine.errors import EngineError
from services.pd.engine.outputs import Failed, Finished, SchedulerOutput
from services.pd.engine.request import MultiModalSpan, Request, SamplingParams

EOS = 2
OTHER_EOS = 0
EOS_IDS = (EOS, OTHER_EOS)  # every request's EOS ids: two, as the tiny Qwen checkpoint lists
TOKEN = 7  # what the runner double samples unless told otherwise
IMG = 0  # image placeholder token
LEASE = 100.0
IMAGES = "abcdefgh"  # 8 images x 6 rows fit the 64-row embedding cache of the random test


class Harness:
    """The engine core with real caches and scheduler, a fake clock and a runner double."""

    def __init__(
        self,
        *,
        num_blocks=64,
        block_size=4,
        budget=16,
        max_num_seqs=8,
        max_model_len=256,
        embedding_tokens=256,
        prefix_caching=True,
        **limits,
    ):
        self.clock = FakeClock()
        self.runner = RunnerDouble()
        self.runner.on_step = lambda out, embeddings: [self._check_chunk(c) for c in out.chunks]
        self.prefill_budget = PrefillBudgetDouble(budget)
        self.core = make_core(
            clock=self.clock,
            runner=self.runner,
            num_blocks=num_blocks,
            block_size=block_size,
            embedding_tokens=embedding_tokens,
            prefix_caching=prefix_caching,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            step_budget=self.prefill_budget,
            **limits,
        )
        self.sched = self.core.scheduler
        self.kv, self.emb = self.core.kv_cache, self.core.embedding_cache
        self.evicted: list[str] = []  # READY entries a Preallocate evicted, in order
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
        request = Request(
            request_id,
            list(prompt),
            SamplingParams(max_tokens=max_tokens, **sampling),
            mm_spans=spans,
            eos_token_ids=EOS_IDS,
        )
        self.core.add_request(request)
        self.requests[request_id] = request
        return request

    def push(self, request_id, mm_hash) -> bool:
        """The encoder's PushEmbedding for this request's reservation; False if rejected."""
        rid = self.reservations[(request_id, mm_hash)]
        try:
            self.core.fill(request_id, rid, mm_hash, EmbeddingDouble(self.emb.num_tokens(mm_hash)))
        except EngineError:  # e.g. a READY pin, or the request already ended
            return False
        return True

    def step(
        self, tokens: dict[str, int] | None = None, prefill_budget: int | None = None, prefill_key=None
    ) -> tuple[SchedulerOutput, list[Request]]:
        """One engine step (prefill chunks within ``prefill_budget``, if given, served in
        ``prefill_key``'s order, if given); checks the budgets and every invariant. Returns the
        requests that ended."""
        self.runner.tokens = dict(tokens or {})
        self.prefill_budget.next = prefill_budget
        self.prefill_budget.key = prefill_key
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
        assert chunk.token_ids == request.all_token_ids[chunk.start_pos : end]
        assert len(chunk.block_ids) * self.kv.block_size >= end
        assert chunk.sample == (end == request.num_tokens)
        for image in chunk.image_slices:  # only READY rows are ever spliced in
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
            row = next((f"{s.mm_hash}:{pos - s.offset}" for s in request.mm_spans if s.offset <= pos < s.end), "")
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


def chunk_of(out, request_id):
    [chunk] = [c for c in out.chunks if c.request_id == request_id]
    return chunk


def force_preempt(h: Harness, request: Request) -> None:
    out = SchedulerOutput()
    h.sched._preempt(request, out, h.clock.now)
    h.check()


def refusal(h: Harness, request_id, prompt, **kwargs) -> EngineError:
    """The error Generate gets for a request the scheduler refuses (nothing is held after it)."""
    with pytest.raises(EngineError) as info:
        h.add(request_id, prompt, **kwargs)
    return info.value

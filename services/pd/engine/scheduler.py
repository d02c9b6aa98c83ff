"""Continuous-batching scheduler of the PD engine. Pure Python: counters and ids.

One token budget per step is shared by decodes and prefill chunks, whose share the caller may cap
(``step_budget.py``: decode keeps its inter-token latency). Decode rows go first, in admission order. Prefill
follows, in the caller's order (``slo.prefill_key``: earliest TTFT deadline first, running prefills and
waiting prompts alike), else running prefills in admission order, then waiting prompts FCFS. A prefill chunk
stops before an image whose embedding is not READY (the text before it prefills while the image is encoded); a
request that cannot move at all for that reason is WAITING_FOR_EMBEDDING. When KV blocks run out, the newest
running request not yet in the step is preempted (its KV recomputed later) and nothing new is admitted in that
step.

The scheduler decides and keeps its queues; it releases nothing a request holds. A request arrives with its
embedding references already taken (``request.span_refs``, by the engine core), and with the prefix blocks
that stand in for its other images pinned; it keeps both until it ends. At admission the block table takes
over its cached prefix (``KVCacheManager.claim_cached_prefix``), and every image span past that prefix must
hold a reference, else the request is reported in ``SchedulerOutput.failed_request_ids``. Requests that finish
are dequeued and marked here; the engine core then frees what they hold. The engine core calls ``schedule``
and ``update_from_output`` alternately; nothing here is thread-safe.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, MutableSequence

from services.pd.engine import spans
from services.pd.engine.embedding_cache import EmbeddingCache
from services.pd.engine.invariants import check_queues
from services.pd.engine.kv_cache import KVCacheManager
from services.pd.engine.outputs import ModelRunnerOutput, SchedulerOutput
from services.pd.engine.request import Request, RequestStatus
from services.pd.engine.scheduler_config import QueueFull, SchedulerConfig, validate_request
from services.pd.engine.slo import PrefillKey
from services.pd.engine.step_budget import TokenBudget


class _Admit(enum.Enum):
    ADMITTED = 0
    BLOCKED = 1  # waits for an image; later requests may go ahead
    NO_ROOM = 2  # not enough KV blocks: stop admitting (FCFS)
    FAILED = 3  # an image it needs is gone: reported, the engine core ends it


class Scheduler:
    """Decides, step by step, which tokens of which requests to compute."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        embedding_cache: EmbeddingCache,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``embedding_cache`` is only asked which images are READY."""
        self.config = config
        self.kv_cache = kv_cache
        self.embedding_cache = embedding_cache
        self._clock = clock
        self.waiting: deque[Request] = deque()  # no KV blocks held
        self.running: list[Request] = []  # holds KV blocks; admission order
        self._requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # for the runner, via the next SchedulerOutput
        # Lifetime counters (for stats and tests).
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens served by the prefix cache, all admissions

    # ------------------------------------------------------------------ queries
    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a step may still do work."""
        return bool(self._requests)

    @property
    def requests(self) -> Iterable[Request]:
        """Every queued request (running or waiting)."""
        return self._requests.values()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_active(self) -> int:
        """Running requests that hold a slot (``max_num_seqs``): all but those waiting for an image."""
        return sum(r.status is not RequestStatus.WAITING_FOR_EMBEDDING for r in self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --------------------------------------------------------------- admission
    def add_request(self, request: Request, *, computed: bool = False) -> None:
        """Queue a new request; ``computed``: its prompt K/V is already in its block table (a KV
        hand-off, ``handoff_core.py``), so it runs at once as a decode row.

        Every image span must hold an embedding reference (``span_refs``) or be
        inside the request's cached prefix (see the module docstring). Raises
        ValueError for a request this server can never run (duplicate id, empty
        or too long prompt, bad spans, more KV than exists) and QueueFull when
        the waiting bounds (``computed``: the slots) are reached; on either, nothing changes.
        """
        if request.request_id in self._requests:
            raise ValueError("a request with this id is already queued")
        validate_request(request, self.config, self.kv_cache.num_blocks_for, self.kv_cache.num_blocks)
        if not computed:
            self.check_room(request.num_tokens)
        elif self.num_active >= self.config.max_num_seqs:
            raise QueueFull(self.config.retry_after_s)
        request.status = RequestStatus.RUNNING if computed else RequestStatus.WAITING
        self._requests[request.request_id] = request
        (self.running if computed else self.waiting).append(request)

    def check_room(self, num_tokens: int) -> None:
        """Raises QueueFull unless one more request of ``num_tokens`` fits the waiting bounds now."""
        num_waiting_tokens = sum(r.num_tokens for r in self.waiting)
        if (
            len(self.waiting) >= self.config.max_waiting_requests
            or num_tokens <= self.config.max_waiting_tokens < num_waiting_tokens + num_tokens
        ):  # longer: invalid
            raise QueueFull(self.config.retry_after_s)

    # ----------------------------------------------------------------- schedule
    def schedule(self, prefill_budget: int | None = None, prefill_key: PrefillKey | None = None) -> SchedulerOutput:
        """Pick the chunks of the next step within the step budget; prefill chunks
        also within ``prefill_budget`` (None = no separate cap).

        Decode rows go first, in admission order. Prefill chunks follow: with
        ``prefill_key``, running prefills and waiting prompts in one order, the
        key's (``slo.prefill_key``: earliest TTFT deadline first); without it,
        running prefills in admission order, then waiting prompts FCFS.
        """
        now = self._clock()
        out = SchedulerOutput()
        budget = TokenBudget(self.config.max_num_batched_tokens, prefill_budget)
        self._schedule_decodes(out, budget, now)
        if budget.num_tokens > 0:
            self._schedule_prefills(out, budget, now, prefill_key)
        out.num_batched_tokens = sum(chunk.num_tokens for chunk in out.chunks)
        out.finished_request_ids, self._finished_ids = self._finished_ids, []
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: TokenBudget, now: float) -> None:
        """One token for every decoding stream that fits the step, preempting newest-first for KV room.

        The newest running request is never one already in this step: decode
        rows are visited in admission order and prefills come after them.
        """
        for request in [r for r in self.running if r.is_decoding]:
            if budget.num_tokens == 0:
                return
            if request.status is RequestStatus.PREEMPTED:
                continue  # an earlier row's victim
            if not self._allocate_or_preempt(request, 1, out, now):
                return  # the request preempted itself: it was the newest, nothing follows
            self._add_chunk(out, request, 1, now)
            budget.spend(1, True)

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput, now: float) -> bool:
        """Make KV room for ``request``, preempting newest-first; False if it went itself."""
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = self.running[-1]
            self._preempt(victim, out, now)
            if victim is request:
                return False
        return True

    def _schedule_prefills(self, out: SchedulerOutput, budget: TokenBudget, now: float, key: PrefillKey | None) -> None:
        prefilling = {id(r) for r in self.running if not r.is_decoding}
        candidates = [*(r for r in self.running if id(r) in prefilling), *self.waiting]
        if key is not None:
            candidates.sort(key=key)
        elif self._shares_with_queue(budget):
            budget.held_for_waiting = budget.num_prefill // 2
        scheduled = {chunk.request_id for chunk in out.chunks}
        admitted: set[int] = set()
        admitting = not out.preempted_request_ids
        free_slots = self.config.max_num_seqs - self.num_active
        for request in candidates:
            running = id(request) in prefilling
            if not running:
                budget.held_for_waiting = 0
            if budget.limit(False) == 0:
                if running and budget.held_for_waiting:
                    continue  # the rest of the share is held for the waiting prompts
                break
            if running:
                if request.status is not RequestStatus.PREEMPTED:  # not a victim of this step
                    free_slots -= self._prefill_running(request, out, budget, now, scheduled, free_slots)
                    admitting = admitting and not out.preempted_request_ids
            elif admitting and free_slots > 0:
                outcome, num_new = self._try_admit(request, budget.limit(False), out, now)
                if outcome is _Admit.NO_ROOM:
                    admitting = False  # FCFS within the order: nothing behind it goes first
                    out.stalled = None if self.running else request.request_id
                elif outcome is _Admit.ADMITTED:
                    admitted.add(id(request))
                    scheduled.add(request.request_id)
                    budget.spend(num_new, False)
                    free_slots -= 1
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)

    def _prefill_running(
        self,
        request: Request,
        out: SchedulerOutput,
        budget: TokenBudget,
        now: float,
        scheduled: set[str],
        free_slots: int,
    ) -> int:
        """The next chunk of a running prefill, preempting the newest request not in this step for room.

        Returns the slots it took: a request that waited for an image takes one again to resume
        (with none free it waits on), one that starts to wait gives its own back (-1).
        """
        resuming = request.status is RequestStatus.WAITING_FOR_EMBEDDING
        if resuming and free_slots <= 0:
            return 0
        num_new, blocking_hash = self._chunk_len(request, request.num_computed_tokens, budget.limit(False))
        if num_new == 0:
            if self._embedding_gone(blocking_hash):
                out.failed_request_ids.append(request.request_id)
            elif not resuming:
                spans.mark_blocked(request, now)
                return -1  # a request waiting for an image holds no slot
            return 0
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = next(
                (r for r in reversed(self.running) if r is not request and r.request_id not in scheduled), None
            )
            if victim is None:
                return 0  # everyone else is in this step: it goes on in a later one
            self._preempt(victim, out, now)
        self._add_chunk(out, request, num_new, now)
        scheduled.add(request.request_id)
        budget.spend(num_new, False)
        return int(resuming)

    def _shares_with_queue(self, budget: TokenBudget) -> bool:
        """Whether this step's prefill share is limited and split with admissible waiting prompts."""
        return (
            self.config.share_prefill_with_queue
            and bool(self.waiting)
            and self.num_active < self.config.max_num_seqs
            and budget.num_prefill < budget.num_tokens
        )

    def _try_admit(self, request: Request, budget: int, out: SchedulerOutput, now: float) -> tuple[_Admit, int]:
        prefix = self.kv_cache.claim_cached_prefix(request)
        if not self._has_embeddings_after(request, prefix.num_tokens):
            out.failed_request_ids.append(request.request_id)
            return _Admit.FAILED, 0
        num_new, _ = self._chunk_len(request, prefix.num_tokens, budget)
        if num_new == 0:
            spans.mark_blocked(request, now)
            return _Admit.BLOCKED, 0
        if not self.kv_cache.allocate_slots(request, num_new, prefix.block_ids):
            return _Admit.NO_ROOM, 0
        request.cached_prefix = None
        request.num_computed_tokens = prefix.num_tokens
        if request.timings.first_scheduled is None:
            request.num_cached_tokens = prefix.num_tokens
        self.num_prefix_hit_tokens += prefix.num_tokens
        self.running.append(request)
        self._add_chunk(out, request, num_new, now)
        return _Admit.ADMITTED, num_new

    def _has_embeddings_after(self, request: Request, start: int) -> bool:
        """Whether every span not computed from ``start`` holds a reference on a live entry."""
        return all(
            index in request.span_refs and not self._embedding_gone(span.mm_hash)
            for index, span in enumerate(request.mm_spans)
            if span.end > start
        )

    def _embedding_gone(self, mm_hash: str | None) -> bool:
        return mm_hash is not None and self.embedding_cache.state(mm_hash) is None

    def _chunk_len(self, request: Request, start: int, budget: int) -> tuple[int, str | None]:
        """Tokens computable from ``start``; with the mm_hash that cut the chunk short."""
        return spans.computable(request, start, budget, self.embedding_cache.is_ready)

    def _add_chunk(self, out: SchedulerOutput, request: Request, num_new: int, now: float) -> None:
        request.status = RequestStatus.RUNNING
        spans.end_embedding_wait(request, now)
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = now
        out.chunks.append(spans.next_chunk(request, num_new))

    def _preempt(self, request: Request, out: SchedulerOutput, now: float) -> None:
        """Drop the request's KV and queue it first for a recompute.

        The engine core takes the references of computed spans again (see
        ``preempted_request_ids``) unless the prefix cache covers them at re-admission.
        """
        _remove(self.running, request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        spans.end_embedding_wait(request, now)
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Account for a computed step; returns the requests that finished.

        Finished requests are dequeued and marked; what they hold is the engine
        core's to free. Chunks of requests finished meanwhile are ignored.
        """
        finished: list[Request] = []
        now = self._clock()
        for chunk in scheduler_output.chunks:
            request = self._requests.get(chunk.request_id)
            if (
                request is None
                or request.status is not RequestStatus.RUNNING
                or request.num_computed_tokens != chunk.start_pos
            ):
                continue
            request.num_computed_tokens += chunk.num_tokens
            self.kv_cache.cache_full_blocks(request)
            if not chunk.sample:
                continue
            sampled = runner_output.sampled.get(chunk.request_id)
            if sampled is None:
                self._finish(request, RequestStatus.FINISHED_ERROR, "the model step sampled no token")
                finished.append(request)
                continue
            if request.grammar is not None and not request.grammar.accept(sampled.token_id):
                # The sampler masks what the grammar forbids, so this is a defect, not the client's doing.
                self._finish(request, RequestStatus.FINISHED_ERROR, "the sampled token broke the request's grammar")
                finished.append(request)
                continue
            request.output_token_ids.append(sampled.token_id)
            if request.timings.first_token is None:
                request.timings.first_token = now
            status = request.stop_status(sampled.token_id, self.config.max_model_len)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    # ----------------------------------------------------------------- finish
    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """Dequeue a request and mark it finished (the engine core frees what it holds).

        Idempotent: returns None when the request is unknown or already finished.
        """
        if not status.is_finished:
            raise ValueError("finish_request needs a FINISHED_* status")
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status, error)
        return request

    def requests_waiting_on(self, mm_hash: str) -> list[Request]:
        """The requests that still need the embedding ``mm_hash``."""
        return [
            r
            for r in self._requests.values()
            if any(s.mm_hash == mm_hash and s.end > r.num_computed_tokens for s in r.mm_spans)
        ]

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        now = self._clock()
        if not _remove(self.running, request):
            _remove(self.waiting, request)
        del self._requests[request.request_id]
        request.status = status
        request.error = error
        spans.end_embedding_wait(request, now)
        request.timings.finished = now
        self._finished_ids.append(request.request_id)

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raise AssertionError unless the queues and the requests' counters agree (the caches: ``EngineCore``)."""
        check_queues(
            self.running, self.waiting, self._requests.keys(), self.config.max_num_seqs, self.kv_cache.block_size
        )


def _remove(queue: MutableSequence[Request], request: Request) -> bool:
    """Remove ``request`` by identity (dataclass ``==`` compares every field)."""
    for index, item in enumerate(queue):
        if item is request:
            del queue[index]
            return True
    return False

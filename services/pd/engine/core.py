"""The PD engine core: one synchronous object that owns a request's whole life.

Read a request's life here, top to bottom, plus ``scheduler.py`` (1 and 2 live in
``embedding_intake.py``, a mixin of this class; E+P+D's hand-off in ``handoff_core.py``):

1. ``preallocate``: before any encoder work, PD promises room for the
   prompt's images. The prompt's cached prefix is looked up, once; images
   inside it are READY at once (the blocks through them are pinned), the
   others are READY from the embedding cache or RESERVED for a push
   (``embedding_cache.py``), all under a lease.
2. ``fill`` (``check_push`` first): the encoder's PushEmbedding lands in a live
   reservation; the tensor goes into the core's embedding store.
3. ``add_request`` (Generate): the request takes over what Preallocate left
   (the same cached prefix, one embedding reference per image span) and
   queues in the scheduler.
4. ``step``: the step budget sizes the prefill share (``step_budget.py``),
   the scheduler picks chunks, the runner computes them, sampled tokens are
   detokenized and become ``RequestEvent``s. A request holds its image
   references until its images are computed into cached K/V; from then the
   blocks through its last image are pinned instead, and the embeddings may
   be evicted for other requests. A preempted request recomputes from those
   pinned blocks, or takes its references back if every image is still
   cached (its pins are then free for others); a preempted request can
   always recompute.
5. Exit: finish, stop string, abort, error, lease expiry or shutdown all end
   in ``_finish``; ``_release`` is the one place that frees what a request
   holds (KV blocks, pins, image references, reservations, its lease).

Single-threaded and synchronous: tests drive it directly; ``bridge.py`` runs it
on the engine thread for the asyncio servers. Tensors are touched only through
the runner (``execute``, ``prepare_embedding``) and the embedding store.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from services.pd.engine import image_refs
from services.pd.engine.cache_events import CacheChanges, CacheSnapshot
from services.pd.engine.embedding_intake import EmbeddingIntakeMixin
from services.pd.engine.engine_stats import EngineStats
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.handoff_core import KVHandoffMixin
from services.pd.engine.invariants import check
from services.pd.engine.kv_handoff import ReservationLimits, Role
from services.pd.engine.outputs import Failed, Finished, ModelRunnerOutput, RequestEvent, SchedulerOutput, StepResult
from services.pd.engine.preallocated import PreallocatedRequests, PreallocationLimits, claim_spans
from services.pd.engine.request import CachedPrefix, Request, RequestStatus
from services.pd.engine.scheduler import QueueFull, Scheduler
from services.pd.engine.step_budget import StepBudget
from services.pd.engine.step_stats import StepStats
from services.pd.engine.streams import RequestStreams

log = logging.getLogger(__name__)

_EMBEDDING_GONE = "an image embedding of this request is no longer cached on this server"
_NOT_DELIVERED = "an image embedding was not delivered before its lease expired"
_SERVED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)  # finished with its answer


class EngineCore(EmbeddingIntakeMixin, KVHandoffMixin):
    """Owns the scheduler, both caches, the embedding tensor store and the model runner.

    ``runner`` has ``execute(SchedulerOutput, embeddings) -> ModelRunnerOutput`` and
    ``prepare_embedding(tensor)`` (to its device and dtype; ValueError for one it cannot
    use). ``role``: which side of a KV hand-off it serves (``handoff_core.py``);
    ``reservation_limits`` bound what one caller's KV reservations hold. ``step_budget`` sizes
    each step's prefill (default: off, the whole step budget);
    ``timer`` measures steps. ``num_deepstack_levels``: DeepStack feature rows a pushed embedding
    carries per token besides its own (Qwen3-VL; 0 = ``[num_tokens, hidden_size]`` embeddings).
    Errors are ``EngineError``s whose messages never echo input.
    """

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        runner: Any,
        tokenizer: Any,
        hidden_size: int,
        lease_sweep_interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        step_budget: StepBudget | None = None,
        timer: Callable[[], float] = time.perf_counter,
        preallocation_limits: PreallocationLimits | None = None,
        role: Role = Role.BOTH,
        export_lease_s: float = 30.0,
        reservation_limits: ReservationLimits | None = None,
        num_deepstack_levels: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.kv_cache = scheduler.kv_cache
        self.embedding_cache = scheduler.embedding_cache
        self.runner = runner
        self.hidden_size = hidden_size
        self.num_deepstack_levels = num_deepstack_levels
        self.sweep_interval_s = lease_sweep_interval_s
        self._clock = clock
        self._embeddings: dict[str, Any] = {}  # mm_hash -> tensor of each READY entry
        self._streams = RequestStreams(tokenizer)  # one per request in the scheduler
        self._preallocated = PreallocatedRequests(preallocation_limits)
        self._next_sweep = 0.0
        self._num_expired_leases = 0
        self.step_stats = StepStats()
        self.step_budget = step_budget or StepBudget.off(scheduler.config.max_num_batched_tokens)
        self._timer = timer
        self._init_handoff(role, export_lease_s, reservation_limits)
        # One recorder for both caches: a batch carries the blocks and embeddings of one loop iteration.
        self.cache_events = self.kv_cache.events
        self.embedding_cache.events = self.cache_events

    # ---------------------------------------------------------------- Generate
    def add_request(self, request: Request) -> None:
        """Admits a Generate: takes over its Preallocate and queues it; raises EngineError, holding nothing."""
        if request.request_id in self._streams:
            raise EngineError(ErrorKind.ALREADY_EXISTS, "a request with this id is already running")
        self._take_over(request)
        try:
            self.scheduler.add_request(request)
        except QueueFull as exc:
            self._release(request.request_id, request)
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "too many waiting requests", exc.retry_after_s) from None
        except ValueError as exc:
            self._release(request.request_id, request)
            raise EngineError(ErrorKind.INVALID_ARGUMENT, str(exc)) from None
        self._streams.open(request)

    def _take_over(self, request: Request) -> None:
        """Gives ``request`` its cached prefix and one embedding reference per span outside it.

        Raises EngineError, holding nothing, when a span has neither a
        reservation, a cached embedding nor cached K/V.
        """
        request_id = request.request_id
        lease_expired = self._preallocated.pop_expired(request_id)
        preallocated = self._preallocated.pop(request_id)
        self._preallocated.let_go(request_id)  # what it holds is the request's now
        if preallocated is not None and preallocated.matches(request):
            request.cached_prefix = preallocated.probe.cached_prefix  # what stands in for images is pinned
            request.block_hashes = preallocated.probe.block_hashes
        taken = self.embedding_cache.take_over(request_id)
        prefix = self.kv_cache.claim_cached_prefix(request) if request.mm_spans else CachedPrefix()
        error, covered_end = claim_spans(request, taken, prefix, self.embedding_cache, lease_expired)
        self._pin_prefix(request, 0 if error else covered_end)
        if error is not None:
            self._release(request_id, request)
            raise error

    # ------------------------------------------------------------------- exits
    def abort(self, request_id: str) -> Request | None:
        """Ends a request (client gone, Abort; a finished prefill's K/V held for its push too); idempotent.
        Returns it if it was queued."""
        self.release_export(request_id)
        return self._end(request_id, RequestStatus.FINISHED_ABORTED)

    def fail_all(self, error: EngineError) -> None:
        """Ends every admitted request with ``error`` (shutdown)."""
        for request_id in self._streams.request_ids:
            self._end(request_id, RequestStatus.FINISHED_ERROR, error)

    def _end(self, request_id: str, status: RequestStatus, error: EngineError | None = None) -> Request | None:
        request = self.scheduler.finish_request(request_id, status, None if error is None else error.message)
        self._finish(request_id, request, error)
        return request

    def _finish(self, request_id: str, request: Request | None, error: EngineError | None) -> None:
        """Every exit ends here: frees what the request holds and tells its stream."""
        self._release(request_id, request)
        if request is not None:
            self._streams.close(request_id, Failed(error) if error else Finished(request.status, request))

    def _release(self, request_id: str, request: Request | None) -> None:
        """Frees a request's KV blocks, pinned prefix, embedding references, reservations and lease.

        The one release path of every exit (idempotent). Reservations are
        ended after the request's own references are dropped, as
        ``EmbeddingCache.cancel_request`` requires.
        """
        if request is not None:
            self._hold_export(request)
            self.kv_cache.free(request)
            image_refs.release_images(request, self.embedding_cache)
            request.cached_prefix = None
            request.grammar = None  # the matcher's memory goes with it
        self.kv_cache.unpin(request_id)
        self._preallocated.pop(request_id)
        self._preallocated.let_go(request_id)
        served = request is not None and request.status in _SERVED
        self.embedding_cache.cancel_request(request_id, served=served)
        self._release_handoff(request_id)

    def sweep(self) -> None:
        """Ends leases past their deadline and fails the requests left waiting on a dropped image."""
        now = self._clock()
        self._next_sweep = now + self.sweep_interval_s
        self._expire_handoffs(now)
        ended = set()
        for preallocated in self._preallocated.expire(now):
            self.kv_cache.unpin(preallocated.probe.request_id)
            self._num_expired_leases += int(preallocated.covers_images)
            ended.add(preallocated.probe.request_id)
        result = self.embedding_cache.expire(now)
        self._num_expired_leases += len(result.expired)
        self._preallocated.remember_expired(r.request_id for r in result.expired)
        ended.update(r.request_id for r in result.expired)
        for request_id in ended:  # room left only by a request whose every lease ran out
            if not self._preallocated.is_pending(request_id) and not self.embedding_cache.has_reservations(request_id):
                self._preallocated.let_go(request_id)
        error = EngineError(ErrorKind.DEADLINE_EXCEEDED, _NOT_DELIVERED)
        for mm_hash in result.dropped_hashes:
            for request in self.scheduler.requests_waiting_on(mm_hash):
                self._end(request.request_id, RequestStatus.FINISHED_ERROR, error)

    # -------------------------------------------------------------------- step
    def step(self) -> StepResult:
        """Sweeps leases when due, runs one scheduled step, returns the events since the last call."""
        self._sweep_if_due()
        executed = self.scheduler.has_unfinished_requests() and self._run_step()
        return StepResult(self._streams.take(), executed)

    def sweep_without_step(self) -> list[RequestEvent]:
        """What ``step`` does but the step, for a loop that holds its steps: leases still end on time.
        Returns the events since the last call."""
        self._sweep_if_due()
        return self._streams.take()

    def _sweep_if_due(self) -> None:
        if self._clock() >= self._next_sweep:
            self.sweep()

    def has_work(self) -> bool:
        """Whether a step may do something now (requests queued or events to hand out)."""
        return self._streams.has_events or self.scheduler.has_unfinished_requests()

    def _run_step(self) -> bool:
        started = self._timer()
        scheduler = self.scheduler
        now = self._clock()
        prefill_budget = self.step_budget.before_step(scheduler.running, started, scheduler.waiting, now)
        scheduler_output = scheduler.schedule(prefill_budget, self.step_budget.prefill_order(now))
        self._after_schedule(scheduler_output)
        scheduled = self._timer()
        self.step_stats.seconds["schedule"] += scheduled - started
        if scheduler_output.is_empty:
            return False
        try:
            runner_output = self.runner.execute(scheduler_output, self._embeddings)
        except Exception:
            log.exception("model step failed; failing the %d requests in the batch", len(scheduler_output.chunks))
            error = EngineError(ErrorKind.INTERNAL, "model execution failed")
            for chunk in scheduler_output.chunks:
                self._end(chunk.request_id, RequestStatus.FINISHED_ERROR, error)
            return True
        executed = self._timer()
        self.step_stats.seconds["execute"] += executed - scheduled
        finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._let_go_of_computed_images(scheduler_output)
        self._emit(scheduler_output, runner_output, finished)
        now = self._timer()
        self.step_stats.seconds["update"] += now - executed
        self.step_stats.record(scheduler_output, runner_output, now - started)
        self.step_budget.after_step(scheduler_output, started, now)
        if log.isEnabledFor(logging.DEBUG):
            decodes = sum(1 for c in scheduler_output.chunks if c.num_tokens == 1)
            log.debug(
                "step: %d decode rows, %d prefill tokens, budget %d, %.1f ms (execute %.1f ms)",
                decodes,
                scheduler_output.num_batched_tokens - decodes,
                prefill_budget,
                1000 * (now - started),
                1000 * (executed - scheduled),
            )
        return True

    def _let_go_of_computed_images(self, scheduler_output: SchedulerOutput) -> None:
        """Computed images: pinned K/V instead of embedding references (``image_refs.py``)."""
        for chunk in scheduler_output.chunks:
            request = self.scheduler.get_request(chunk.request_id)
            if request is not None:
                image_refs.let_go_of_computed_images(request, self.kv_cache, self.embedding_cache)

    def _after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Ends the requests whose image is gone before the step runs; looks after preempted ones' pins."""
        for request_id in scheduler_output.failed_request_ids:
            self._end(request_id, RequestStatus.FINISHED_ERROR, EngineError(ErrorKind.UNAVAILABLE, _EMBEDDING_GONE))
        for request_id in scheduler_output.preempted_request_ids:
            self._retake_images(request_id)
        if scheduler_output.stalled is not None:
            # Nothing runs and pinned blocks of waiting requests leave the next one no room: the
            # others give theirs up; one whose images are gone then fails at admission (UNAVAILABLE).
            for request in list(self.scheduler.waiting):
                if request.request_id != scheduler_output.stalled and not self._retake_images(request.request_id):
                    self.kv_cache.unpin(request.request_id)

    def _retake_images(self, request_id: str) -> bool:
        request = self.scheduler.get_request(request_id)
        return request is not None and image_refs.retake_images(request, self.kv_cache, self.embedding_cache)

    def _emit(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, finished: list[Request]
    ) -> None:
        """Turns sampled tokens into events; ends the requests that finished or hit a stop string."""
        ended = {request.request_id: request for request in finished}
        for chunk in scheduler_output.chunks:
            request_id = chunk.request_id
            sampled = runner_output.sampled.get(request_id)
            request = ended.get(request_id) or self.scheduler.get_request(request_id)
            if sampled is None or request is None or request_id not in self._streams:
                continue
            if request.status is RequestStatus.FINISHED_ERROR:  # its token was refused (its grammar's)
                continue
            if self._streams.add_token(request, sampled) and not request.is_finished:
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
                ended[request_id] = request
            if len(request.output_token_ids) == 1:
                self.step_budget.first_token(request)
        for request_id, request in ended.items():
            failed = request.status is RequestStatus.FINISHED_ERROR  # the step sampled no token for it
            if not failed:
                self.step_budget.finished(request)
            self._finish(
                request_id,
                request,
                EngineError(ErrorKind.INTERNAL, request.error or "the step failed") if failed else None,
            )

    # ------------------------------------------------------------ cache events
    def cache_snapshot(self) -> CacheSnapshot:
        """What both caches hold now; changes are recorded from here on (``take_cache_changes``)."""
        self.cache_events.enable()
        return CacheSnapshot(
            self.kv_cache.block_size, tuple(self.kv_cache.cached_keys()), tuple(self.embedding_cache.ready_entries())
        )

    def take_cache_changes(self) -> CacheChanges | None:
        """The caches' net changes since the last call (None: none, or nobody asked for a snapshot yet)."""
        return self.cache_events.take()

    # ------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        """Everything the core reports about itself, at this moment."""
        kv, embedding = self.kv_cache, self.embedding_cache.stats()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_live_requests=len(self._streams),
            num_kv_blocks_total=kv.num_blocks,
            num_kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            num_kv_blocks_pinned=kv.num_pinned_blocks,
            num_kv_leases=self._preallocated.num_kv_leases,
            num_prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_running_tokens=sum(map(_uncached_tokens, self.scheduler.running)),
            num_waiting_tokens=sum(map(_uncached_tokens, self.scheduler.waiting)),
            **dataclasses.asdict(embedding),
            num_embeddings_stored=len(self._embeddings),
            num_expired_leases=self._num_expired_leases,
            steps=self.step_stats.snapshot(),
            budget=self.step_budget.snapshot(),
            **self.handoff_stats(),
        )

    def check_integrity(self) -> None:
        """Raises AssertionError unless the scheduler, both caches, the store and the streams agree."""
        self.scheduler.check_integrity()
        requests = list(self.scheduler.requests)
        self.kv_cache.check_integrity(requests + self.handoff_probes())
        self.embedding_cache.check_integrity()
        check(all(self.embedding_cache.is_ready(h) for h in self._embeddings), "a stored tensor has no READY entry")
        check(
            self.embedding_cache.stats().ready_tokens
            == sum(self.embedding_cache.num_tokens(h) for h in self._embeddings),
            "a READY entry has no tensor",
        )
        check(set(self._streams.request_ids) == {r.request_id for r in requests}, "streams and queues disagree")


def _uncached_tokens(request: Request) -> int:
    """Tokens the request has computed or will compute here: prompt tokens past its cached prefix, plus its
    output so far. A request still waiting counts the prefix found for it (at Preallocate, or when a step
    last tried it), not nothing: the proxy that routed it counts only what the cache did not hold, and a
    waiting follow-up turn would otherwise look a thousand tokens heavier to it until the next report."""
    cached = request.num_cached_tokens
    if request.cached_prefix is not None:
        cached = max(cached, request.cached_prefix.num_tokens)
    return request.num_tokens - cached

"""The engine core's embedding side: Preallocate, and the pushes that fill its reservations. Pure Python.

``EngineCore`` inherits this mixin (``core.py``: a request's whole life). A
Preallocate claims every image of a prompt before any encoder work: images
its cached prefix covers are READY at once (the blocks through them are
pinned), the others are READY from the embedding cache or RESERVED for a
push, all under a lease and within the bounds on held Preallocates. A push
lands in a live reservation; its tensor goes into the core's embedding store.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from services.pd.engine import spans
from services.pd.engine.embedding_cache import EmbeddingCache
from services.pd.engine.embedding_records import (
    AlreadyFilled,
    EmbeddingCacheFull,
    EntryState,
    LeaseExpired,
    Preallocation,
    ReservationNotFound,
    ReservationRejected,
)
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.outputs import Allocation
from services.pd.engine.preallocated import Preallocated, PreallocatedRequests
from services.pd.engine.request import CachedPrefix, MultiModalSpan, Request, SamplingParams
from services.pd.engine.scheduler_config import QueueFull

if TYPE_CHECKING:
    from services.pd.engine.kv_cache import KVCacheManager
    from services.pd.engine.scheduler import Scheduler
    from services.pd.engine.streams import RequestStreams

_PREALLOCATED_RETRY_S = 0.5  # a held Preallocate ends within a lease: its Generate, an abort or expiry


def _allocation(mm_hash: str, state: EntryState, reservation_id: str) -> Allocation:
    return Allocation(mm_hash, state is EntryState.READY, reservation_id)


class EmbeddingIntakeMixin:
    """Preallocate and the embedding pushes, on the core's caches and embedding store."""

    scheduler: Scheduler
    kv_cache: KVCacheManager
    embedding_cache: EmbeddingCache
    runner: Any
    _streams: RequestStreams
    _preallocated: PreallocatedRequests
    _embeddings: dict[str, Any]
    _clock: Callable[[], float]

    # ------------------------------------------------------------ Preallocate
    def preallocate(
        self,
        request_id: str,
        spans: Sequence[MultiModalSpan],
        lease_s: float,
        prompt_token_ids: Sequence[int] = (),
        peer: str = "",
        cache_salt: str = "",
    ) -> list[Allocation]:
        """Claims every image of a prompt, all or nothing; raises EngineError, changing nothing.

        ``peer`` is the caller's address: requests holding room before their
        Generate are bounded in total and per caller (``PreallocationLimits``).
        """
        if request_id in self._streams:
            raise EngineError(ErrorKind.ALREADY_EXISTS, "a request with this id is already running")
        if not self._preallocated.has_room(peer):
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "too many preallocated requests", _PREALLOCATED_RETRY_S)
        try:  # no room held, and no encoder work spent, for a request Generate would refuse
            self.scheduler.check_room(len(prompt_token_ids))
        except QueueFull as exc:
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "too many waiting requests", exc.retry_after_s) from None
        now = self._clock()
        probe = Request(
            request_id, list(prompt_token_ids), SamplingParams(), mm_spans=list(spans), cache_salt=cache_salt
        )
        looked_up = bool(spans and prompt_token_ids)
        prefix = self.kv_cache.claim_cached_prefix(probe) if looked_up else CachedPrefix()
        rest = [s for s in spans if not prefix.covers(s)]
        granted = self._reserve(request_id, rest, now, lease_s) if rest else Preallocation([], [])
        self._drop_embeddings(granted.evicted)
        if looked_up:  # Generate takes this prefix over; what stands in for images stays pinned
            covered_end = max((s.end for s in spans if prefix.covers(s)), default=0)
            self._pin_prefix(probe, covered_end)
            self._preallocated.add(Preallocated(probe, now + lease_s, covers_images=covered_end > 0))
        if looked_up or granted.items:
            self._preallocated.hold(request_id, peer)
        answers = iter(granted.items)
        return [
            Allocation(span.mm_hash, True, self._preallocated.new_pin_id(), via_prefix_cache=True)
            if prefix.covers(span)
            else _allocation(*next(answers))
            for span in spans
        ]

    def _pin_prefix(self, request: Request, num_tokens: int) -> None:
        """Pins only the cached blocks of the first ``num_tokens`` tokens: the K/V standing in
        for images the request holds no embedding for, until it ends."""
        prefix = request.cached_prefix
        blocks = prefix.block_ids[: self.kv_cache.num_blocks_for(num_tokens)] if num_tokens and prefix else ()
        self.kv_cache.pin(request.request_id, blocks)

    def _reserve(self, request_id: str, spans: list[MultiModalSpan], now: float, lease_s: float) -> Preallocation:
        try:
            return self.embedding_cache.preallocate(
                request_id, [(s.mm_hash, s.num_tokens) for s in spans], now + lease_s, now
            )
        except EmbeddingCacheFull as exc:
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "embedding cache is full", exc.retry_after_s) from None
        except ValueError as exc:
            # Our own message (size conflict or over total capacity), never input.
            raise EngineError(ErrorKind.INVALID_ARGUMENT, str(exc)) from None

    # ------------------------------------------------------------------ pushes
    def check_push(self, request_id: str, reservation_id: str, mm_hash: str, num_tokens: int) -> bool:
        """Whether a push is wanted: False for a repeat of one that landed (a retried Encode).

        Raises NOT_FOUND, DEADLINE_EXCEEDED (lease over) or FAILED_PRECONDITION
        for a push whose reservation is not live or whose size differs.
        """
        if self._preallocated.is_pin_id(reservation_id):
            raise EngineError(
                ErrorKind.FAILED_PRECONDITION, "push rejected: reservation is a pin of cached KV, not a push target"
            )
        try:
            self.embedding_cache.check_push(request_id, reservation_id, mm_hash, num_tokens, self._clock())
        except AlreadyFilled:
            return False
        except ReservationNotFound:
            raise EngineError(ErrorKind.NOT_FOUND, "unknown reservation") from None
        except LeaseExpired:
            raise EngineError(ErrorKind.DEADLINE_EXCEEDED, "push rejected: reservation lease expired") from None
        except ReservationRejected as exc:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, f"push rejected: {exc}") from None
        return True

    def fill(self, request_id: str, reservation_id: str, mm_hash: str, embedding: Any) -> bool:
        """Stores a pushed ``[num_tokens, hidden]`` embedding in its reservation; False for a repeat, which
        changes nothing. Refuses as ``check_push`` does."""
        if not self.check_push(request_id, reservation_id, mm_hash, int(embedding.shape[0])):
            return False
        try:
            tensor = self.runner.prepare_embedding(embedding)
        except ValueError as exc:
            raise EngineError(ErrorKind.INVALID_ARGUMENT, f"embedding rejected: {exc}") from None
        if self.embedding_cache.fill(request_id, reservation_id, mm_hash, self._clock()):
            self._embeddings[mm_hash] = tensor
            self._unblock(mm_hash)
        return True

    def fill_cached(self, request_id: str, reservation_id: str, mm_hash: str) -> bool:
        """Fills a reservation from the embedding already READY here; False when it is not."""
        if not self.embedding_cache.is_ready(mm_hash):
            return False
        if self.check_push(request_id, reservation_id, mm_hash, self.embedding_cache.num_tokens(mm_hash)):
            self.embedding_cache.fill(request_id, reservation_id, mm_hash, self._clock())
        return True

    def _unblock(self, mm_hash: str) -> None:
        """Ends the image wait of the requests that the embedding ``mm_hash``, just READY, lets go on
        (an entry becomes READY only in ``fill``: nothing can be blocked on one ``fill_cached`` finds).

        From here on they wait for a step like any prompt, and the step budget
        counts them as such (``slo.pending_prompts``): a burst of image prompts
        whose embeddings arrived together is then prefilled as a burst, not one
        prompt per step until the scheduler reaches each of them."""
        now = self._clock()
        for request in self.scheduler.requests_waiting_on(mm_hash):
            spans.end_wait_if_computable(request, now, self.embedding_cache.is_ready)

    def start_image_waits(self) -> None:
        """Starts the image wait of every prompt whose next image is not here (``spans.start_wait_if_blocked``):
        a loop that holds its steps for the image calls it, so that the wait counts as such, not as queueing."""
        now = self._clock()
        for request in itertools.chain(self.scheduler.running, self.scheduler.waiting):
            spans.start_wait_if_blocked(request, now, self.embedding_cache.is_ready)

    def _drop_embeddings(self, mm_hashes: Sequence[str]) -> None:
        """Frees the tensors of entries a cache call removed."""
        for mm_hash in mm_hashes:
            self._embeddings.pop(mm_hash, None)

    # ------------------------------------------------------------------ leases

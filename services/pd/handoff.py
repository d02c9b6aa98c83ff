"""The engine-thread side of the image hand-off: Preallocate, PushEmbedding, Generate.

Preallocate answers, per image item:

- READY when the prompt's prefix up to the end of the image is already in
  prefix-cached KV blocks (the image need not be encoded, nor even be in the
  embedding cache). Those blocks are pinned under the request id
  (``KVCacheManager.pin``) so they cannot be evicted before Generate; the
  answer's reservation id is a pin id, never a push target.
- READY when the embedding is in the embedding cache (pinned there).
- RESERVED otherwise: room is held and the encoder must push.

Generate (``take_over``) turns everything the request holds into what the
scheduler expects: one embedding reference per span that still needs its
embedding, and a KV pin (same owner: the request id) covering the spans that
do not. The scheduler drops the pin at admission. Leases end unused
reservations and pins (``expire``); ``cancel`` ends them at once.

Not thread-safe: only the engine thread calls it.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.pd.embedding_cache import (
    EmbeddingCache,
    EmbeddingCacheFull,
    EntryState,
    ReservationNotFound,
    ReservationRejected,
)
from services.pd.errors import EngineError, ErrorKind
from services.pd.kv_cache import KVCacheManager
from services.pd.request import MultiModalSpan, Request, SamplingParams
from services.pd.scheduler import QueueFull

_NO_RESERVATION = "an image of this request has no reservation on this PD (call Preallocate first)"
_LEASE_EXPIRED = "the request's reservation lease expired before Generate took it over"
EXPIRED_MEMORY = 4096
"""Request ids whose lease ran out, remembered so a late Generate hears DEADLINE_EXCEEDED (bounded)."""


@dataclass(frozen=True)
class Allocation:
    """Outcome of Preallocate for one item."""

    mm_hash: str
    ready: bool
    reservation_id: str
    via_prefix_cache: bool = False   # READY because its KV is cached (not its embedding)


class EmbeddingHandoff:
    """Reservations, pushes and take-over of image embeddings (see the module docstring)."""

    def __init__(
        self,
        embedding_cache: EmbeddingCache,
        kv_cache: KVCacheManager,
        embeddings: dict[str, Any],
        prepare_embedding: Callable[[Any], Any],
        admit: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``admit(num_prompt_tokens)`` raises ``QueueFull`` when Generate would be refused
        now (``Scheduler.check_room``): Preallocate then reserves nothing."""
        self.embedding_cache = embedding_cache
        self._admit = admit
        self.kv_cache = kv_cache
        self._embeddings = embeddings            # mm_hash -> tensor, owned by the engine
        self._prepare = prepare_embedding
        self._clock = clock
        self._kv_leases: dict[str, float] = {}   # request_id -> deadline of its KV pin
        self._pin_prefix = f"kvpin-{uuid.uuid4().hex[:12]}"
        self._pin_ids = itertools.count()
        # Leases that ran out unused: one per image reservation, one per prefix-KV pin (metrics).
        self.num_expired_leases = 0
        self._expired_requests: OrderedDict[str, None] = OrderedDict()

    @property
    def num_kv_leases(self) -> int:
        return len(self._kv_leases)

    # ------------------------------------------------------------ Preallocate
    def preallocate(self, request_id: str, prompt_token_ids: Sequence[int], spans: Sequence[MultiModalSpan],
                    lease_s: float) -> list[Allocation]:
        """Claim every item, all or nothing; raises EngineError (nothing changed) on failure."""
        try:  # admission first: no room held, and no encoder work spent, for a request Generate would refuse
            if self._admit is not None:
                self._admit(len(prompt_token_ids))
        except QueueFull as exc:
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "too many waiting requests", exc.retry_after_s) from None
        now = self._clock()
        block_ids, num_hit = self._cached_prefix(request_id, prompt_token_ids, spans)
        covered = [s for s in spans if s.end <= num_hit]
        rest = [s for s in spans if s.end > num_hit]
        try:
            granted = self.embedding_cache.preallocate(
                request_id, [(s.mm_hash, s.num_tokens) for s in rest], now + lease_s, now) if rest else []
        except EmbeddingCacheFull as exc:
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "embedding cache is full", exc.retry_after_s) from None
        except ValueError as exc:
            # Our own message (size conflict or over total capacity), never input.
            raise EngineError(ErrorKind.INVALID_ARGUMENT, str(exc)) from None
        if covered:
            self.kv_cache.pin(request_id, block_ids[: self.kv_cache.num_blocks_for(covered[-1].end)])
            self._kv_leases[request_id] = now + lease_s
        answers = iter(granted)
        allocations = []
        for span in spans:
            if span.end <= num_hit:
                pin_id = f"{self._pin_prefix}-{next(self._pin_ids)}"
                allocations.append(Allocation(span.mm_hash, True, pin_id, via_prefix_cache=True))
            else:
                mm_hash, state, reservation_id = next(answers)
                allocations.append(Allocation(mm_hash, state is EntryState.READY, reservation_id))
        return allocations

    def _cached_prefix(self, request_id: str, prompt_token_ids: Sequence[int],
                       spans: Sequence[MultiModalSpan]) -> tuple[list[int], int]:
        if not spans or not prompt_token_ids:
            return [], 0
        probe = Request(request_id, list(prompt_token_ids), SamplingParams(), mm_spans=list(spans))
        return self.kv_cache.get_computed_blocks(probe)

    # ------------------------------------------------------------------ pushes
    def check_push(self, request_id: str, reservation_id: str, mm_hash: str, num_tokens: int) -> None:
        """Rejects a push whose reservation is not live (NOT_FOUND / FAILED_PRECONDITION)."""
        if reservation_id.startswith(self._pin_prefix):
            raise EngineError(ErrorKind.FAILED_PRECONDITION,
                              "push rejected: reservation is a pin of cached KV, not a push target")
        try:
            self.embedding_cache.check_push(request_id, reservation_id, mm_hash, num_tokens, self._clock())
        except ReservationNotFound:
            raise EngineError(ErrorKind.NOT_FOUND, "unknown reservation") from None
        except ReservationRejected as exc:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, f"push rejected: {exc}") from None

    def fill(self, request_id: str, reservation_id: str, mm_hash: str, embedding: Any) -> None:
        """Store a validated push ([num_tokens, hidden]); a duplicate is dropped."""
        self.check_push(request_id, reservation_id, mm_hash, int(embedding.shape[0]))
        tensor = self._prepare(embedding)
        if self.embedding_cache.fill(request_id, reservation_id, mm_hash, self._clock()):
            self._embeddings[mm_hash] = tensor

    # --------------------------------------------------------------- Generate
    def take_over(self, request: Request) -> set[int]:
        """Returns the indices of the spans the request now holds a reference for.

        Every other span is covered by cached KV, pinned under the request id.
        Raises EngineError, holding nothing, when a span
        has neither a reservation, a cached embedding nor cached KV.
        """
        lease_expired = request.request_id in self._expired_requests
        self._expired_requests.pop(request.request_id, None)
        taken = self.embedding_cache.take_over(request.request_id)
        self._kv_leases.pop(request.request_id, None)   # the request owns its pin now
        block_ids, num_hit = self.kv_cache.get_computed_blocks(request) if request.mm_spans else ([], 0)
        held: set[int] = set()
        covered_end = 0
        for index, span in enumerate(request.mm_spans):
            if span.mm_hash in taken:
                taken.remove(span.mm_hash)
                held.add(index)
            elif span.end <= num_hit:
                covered_end = span.end
            elif self.embedding_cache.acquire(span.mm_hash):
                held.add(index)
            else:
                self.release(request, held)
                for mm_hash in taken:
                    self.embedding_cache.release(mm_hash)
                self.cancel(request.request_id)
                # A lease that ran out is a timeout (the proxy answers 504), not a protocol error.
                if lease_expired:
                    raise EngineError(ErrorKind.DEADLINE_EXCEEDED, _LEASE_EXPIRED)
                raise EngineError(ErrorKind.FAILED_PRECONDITION, _NO_RESERVATION)
        # A reference left over (an item preallocated but absent from the
        # prompt) would pin its entry forever: drop it now.
        for mm_hash in taken:
            self.embedding_cache.release(mm_hash)
        if covered_end:
            self.kv_cache.pin(request.request_id, block_ids[: self.kv_cache.num_blocks_for(covered_end)])
        else:
            self.kv_cache.unpin(request.request_id)
        return held

    def release(self, request: Request, held: set[int]) -> None:
        """Undo ``take_over`` for a request the scheduler refused."""
        for index in sorted(held):
            self.embedding_cache.release(request.mm_spans[index].mm_hash)
        self.kv_cache.unpin(request.request_id)

    # ------------------------------------------------------- cancel / expire
    def cancel(self, request_id: str) -> None:
        """Ends the request's reservations and pins (abort, failure). Idempotent."""
        self.embedding_cache.cancel_request(request_id)
        if self._kv_leases.pop(request_id, None) is not None:
            self.kv_cache.unpin(request_id)

    def expire(self, now: float) -> list[str]:
        """Ends leases past their deadline; returns the hashes whose pending push is gone."""
        expired_pins = [r for r, deadline in self._kv_leases.items() if deadline < now]
        for request_id in expired_pins:
            del self._kv_leases[request_id]
            self.kv_cache.unpin(request_id)
        result = self.embedding_cache.expire(now)
        self.num_expired_leases += len(expired_pins) + len(result.expired)
        for request_id in [*expired_pins, *(r.request_id for r in result.expired)]:
            self._expired_requests[request_id] = None
            self._expired_requests.move_to_end(request_id)
        while len(self._expired_requests) > EXPIRED_MEMORY:
            self._expired_requests.popitem(last=False)
        dropped = result.dropped_hashes
        for mm_hash in dropped:
            self._embeddings.pop(mm_hash, None)
        return dropped

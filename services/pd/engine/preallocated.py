"""What a Preallocate leaves for the Generate that follows it. Pure Python.

Preallocate looks up the prompt's cached prefix once (the lookup pins the
blocks under the request id) and answers READY for every image inside it.
Generate then takes that same prefix over, if its prompt is the one
Preallocate saw. Until then the prefix is held under a lease; a lease that
runs out unpins it, and its request id is remembered (a bounded number of
them) so a late Generate is told its lease expired rather than that it never
preallocated.

It also bounds them: a Preallocate holds room (pinned blocks, image
reservations) before any Generate, so the number of requests preallocated
and not yet generating is capped in total and per caller address, and lease
expiry pops only the leases that ended (a heap), so a flood of small
Preallocates costs the engine thread no more per sweep than what expires.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.leases import LeaseQueue
from services.pd.engine.request import CachedPrefix, Request

if TYPE_CHECKING:
    from services.pd.engine.embedding_cache import EmbeddingCache

EXPIRED_MEMORY = 4096
"""Request ids whose lease ran out, remembered so a late Generate hears DEADLINE_EXCEEDED (bounded)."""
_NO_RESERVATION = "an image of this request has no reservation on this PD (call Preallocate first)"
_LEASE_EXPIRED = "the request's reservation lease expired before Generate took it over"
_SIZE_DIFFERS = "an image span's length differs from the embedding cached for that image"
DEFAULT_MAX_PREALLOCATED = 1024
"""Requests preallocated and not yet generating, in total (``--max-preallocations``)."""
DEFAULT_MAX_PREALLOCATED_PER_PEER = 256
"""... and per caller address (``--max-preallocations-per-peer``)."""


@dataclass(frozen=True)
class PreallocationLimits:
    """How many requests may hold room from a Preallocate before their Generate."""

    max_total: int = DEFAULT_MAX_PREALLOCATED
    max_per_peer: int = DEFAULT_MAX_PREALLOCATED_PER_PEER

    def __post_init__(self) -> None:
        if self.max_total <= 0 or self.max_per_peer <= 0:
            raise ValueError("preallocation limits must be positive")


@dataclass
class Preallocated:
    """One Preallocate not yet followed by its Generate."""

    probe: Request  # the prompt and spans Preallocate saw, with their cached prefix and block hashes
    deadline: float  # monotonic seconds
    covers_images: bool  # some item was answered READY because its K/V is in the prefix

    def matches(self, request: Request) -> bool:
        """Whether ``request`` is the prompt this Preallocate looked up."""
        return (
            request.prompt_token_ids == self.probe.prompt_token_ids
            and request.mm_spans == self.probe.mm_spans
            and request.cache_salt == self.probe.cache_salt  # the block hashes it carries are the salt's
        )


class PreallocatedRequests:
    """Preallocations by request id, and the ids whose lease expired. Not thread-safe."""

    def __init__(self, limits: PreallocationLimits | None = None) -> None:
        self.limits = limits or PreallocationLimits()
        self._pending: dict[str, Preallocated] = {}
        self._leases = LeaseQueue()  # of _pending's request ids
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._owners: dict[str, str] = {}  # request id -> caller address, of every request holding room
        self._per_peer: dict[str, int] = {}
        # Ids of items answered READY because their K/V is cached: they name a
        # pin, never a push target. Per instance, so a restart's ids never match.
        self._pin_prefix = f"kvpin-{uuid.uuid4().hex[:12]}"
        self._pin_ids = itertools.count()

    @property
    def num_kv_leases(self) -> int:
        """Leases whose pinned prefix answered some item READY."""
        return sum(1 for p in self._pending.values() if p.covers_images)

    def new_pin_id(self) -> str:
        """A reservation id for an item answered READY from the prefix cache."""
        return f"{self._pin_prefix}-{next(self._pin_ids)}"

    def is_pin_id(self, reservation_id: str) -> bool:
        return reservation_id.startswith(self._pin_prefix)

    def add(self, preallocated: Preallocated) -> None:
        self._pending[preallocated.probe.request_id] = preallocated
        self._leases.push(preallocated.deadline, preallocated.probe.request_id)

    # ----------------------------------------------------------- the bounds
    @property
    def num_holding(self) -> int:
        """Requests holding room from a Preallocate, not yet generating."""
        return len(self._owners)

    def has_room(self, peer: str) -> bool:
        """Whether one more request of ``peer`` may hold room."""
        return len(self._owners) < self.limits.max_total and self._per_peer.get(peer, 0) < self.limits.max_per_peer

    def hold(self, request_id: str, peer: str) -> None:
        """Counts ``request_id`` (of ``peer``) as holding room until ``let_go``."""
        if request_id in self._owners:
            return
        self._owners[request_id] = peer
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1

    def let_go(self, request_id: str) -> None:
        """Stops counting ``request_id`` (its Generate took over, it ended, or its leases ran out). Idempotent."""
        peer = self._owners.pop(request_id, None)
        if peer is None:
            return
        left = self._per_peer[peer] - 1
        if left:
            self._per_peer[peer] = left
        else:
            del self._per_peer[peer]

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def pop(self, request_id: str) -> Preallocated | None:
        return self._pending.pop(request_id, None)

    def pop_expired(self, request_id: str) -> bool:
        """Whether a lease of ``request_id`` expired (forgotten once asked)."""
        if request_id not in self._expired:
            return False
        del self._expired[request_id]
        return True

    def expire(self, now: float) -> list[Preallocated]:
        """Removes and returns the preallocations whose lease ended before ``now``."""

        def is_live(request_id: str, deadline: float) -> bool:  # not popped, nor added again since
            pending = self._pending.get(request_id)
            return pending is not None and pending.deadline == deadline

        ended = [p for r in self._leases.pop_ended(now, is_live) if (p := self._pending.pop(r, None)) is not None]
        self.remember_expired(p.probe.request_id for p in ended)
        return ended

    def remember_expired(self, request_ids: Iterable[str]) -> None:
        """Records ids whose lease (of a prefix or an image reservation) ran out."""
        for request_id in request_ids:
            self._expired[request_id] = None
            self._expired.move_to_end(request_id)
        while len(self._expired) > EXPIRED_MEMORY:
            self._expired.popitem(last=False)


def claim_spans(
    request: Request, taken: list[str], prefix: CachedPrefix, embedding_cache: EmbeddingCache, lease_expired: bool
) -> tuple[EngineError | None, int]:
    """Gives ``request`` one embedding reference per image span outside ``prefix``, at Generate.

    ``taken`` are the references its Preallocate left (``EmbeddingCache.take_over``);
    a span without one takes a cached embedding, or fails. Returns the error
    (None: every span is held) and the end of the last span the prefix covers
    (the K/V standing in for those images stays pinned). References left over
    (preallocated, absent from the prompt) are released: they would pin their
    entries forever. On an error the caller releases what the request holds.
    """
    error, covered_end = None, 0
    for index, span in enumerate(request.mm_spans):
        if span.mm_hash in taken:
            taken.remove(span.mm_hash)
            request.span_refs.add(index)
        elif prefix.covers(span):
            covered_end = span.end
            continue
        elif embedding_cache.acquire(span.mm_hash):
            request.span_refs.add(index)
        else:
            error = _missing_image(lease_expired)
            break
        if embedding_cache.num_tokens(span.mm_hash) != span.num_tokens:
            error = EngineError(ErrorKind.INVALID_ARGUMENT, _SIZE_DIFFERS)
            break
    for mm_hash in taken:
        embedding_cache.release(mm_hash)
    return error, covered_end


def _missing_image(lease_expired: bool) -> EngineError:
    # A lease that ran out is a timeout (the proxy answers 504), not a protocol error.
    if lease_expired:
        return EngineError(ErrorKind.DEADLINE_EXCEEDED, _LEASE_EXPIRED)
    return EngineError(ErrorKind.FAILED_PRECONDITION, _NO_RESERVATION)

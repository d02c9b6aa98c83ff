"""Records and errors of the PD's embedding cache (see ``embedding_cache.py``)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class EntryState(enum.IntEnum):
    """State of a cache entry; also the per-item answer of ``preallocate``."""

    RESERVED = 0  # room held, waiting for a push
    READY = 1  # embedding present in the engine


class ReservationKind(enum.Enum):
    PUSH = "push"  # the holder expects the encoder to push this embedding
    PIN = "pin"  # the embedding is READY; keep it until Generate takes over


class EmbeddingCacheFull(Exception):
    """Not enough room even after evicting everything evictable (gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, retry_after_s: float):
        super().__init__(f"embedding cache full; retry after {retry_after_s:.2f}s")
        self.retry_after_s = retry_after_s


class ReservationNotFound(Exception):
    """No such reservation was ever known here (gRPC NOT_FOUND)."""


class ReservationRejected(Exception):
    """The push does not match a live reservation (gRPC FAILED_PRECONDITION)."""


class LeaseExpired(ReservationRejected):
    """The reservation's lease ran out before the push (gRPC DEADLINE_EXCEEDED: a timeout)."""


class AlreadyFilled(ReservationRejected):
    """This reservation was filled already: a repeated push (a retried Encode) carries nothing new.

    ``num_tokens`` is the reservation's size, so that the repeat is checked like the original.
    """

    def __init__(self, num_tokens: int):
        super().__init__("reservation already filled")
        self.num_tokens = num_tokens


@dataclass
class Reservation:
    """A request's claim on one entry, valid until ``lease_deadline`` (monotonic s)."""

    reservation_id: str
    request_id: str
    mm_hash: str
    lease_deadline: float
    kind: ReservationKind
    num_tokens: int  # rows of the entry it reserves
    filled: bool = False
    # A reference already stands for it (taken over) or its request is gone:
    # the reservation ends as soon as it is filled.
    end_on_fill: bool = False


@dataclass
class CacheEntry:
    """One embedding's bookkeeping: size, state, references and the reservations that keep it."""

    mm_hash: str
    num_tokens: int
    state: EntryState
    ref_count: int = 0
    reservation_ids: set[str] = field(default_factory=set)


class Tombstone(NamedTuple):
    """What is remembered of a removed reservation, to answer a late push precisely."""

    why: str  # "lease expired", "cancelled", "served" (by another push), "not needed" (its request was served),
    # "taken over", "already filled"
    request_id: str
    mm_hash: str
    num_tokens: int
    filled: bool


class ExpiryResult(NamedTuple):
    """What ``EmbeddingCache.expire`` ended."""

    expired: list[Reservation]
    dropped_hashes: list[str]  # RESERVED entries removed: fail requests waiting on them


class Preallocation(NamedTuple):
    """What ``EmbeddingCache.preallocate`` granted."""

    items: list[tuple[str, EntryState, str]]  # per item: (mm_hash, state, reservation_id)
    evicted: list[str]  # READY entries evicted for room: drop their tensors


@dataclass(frozen=True)
class EmbeddingCacheStats:
    """Gauges of the embedding cache, in rows (tokens) unless named ``num_*``."""

    capacity_tokens: int
    used_tokens: int  # reserved + ready
    reserved_tokens: int  # waiting for a push
    ready_tokens: int
    evictable_tokens: int  # ready, unreferenced and unreserved
    num_entries: int
    num_reservations: int


def item_sizes(items: Sequence[tuple[str, int]], entries: Mapping[str, CacheEntry]) -> dict[str, int]:
    """``mm_hash -> num_tokens`` of a Preallocate's items; ValueError for a size that is not positive
    or that differs from another item's or the cached entry's for the same image."""
    sizes: dict[str, int] = {}
    for mm_hash, num_tokens in items:
        if num_tokens <= 0:
            raise ValueError("num_tokens must be positive")
        known = sizes.get(mm_hash)
        entry = entries.get(mm_hash)
        if entry is not None and known is None:
            known = entry.num_tokens
        if known is not None and known != num_tokens:
            raise ValueError("num_tokens differs from the cached entry for this image")
        sizes[mm_hash] = num_tokens
    return sizes

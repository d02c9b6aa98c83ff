"""The reservations of the PD's embedding cache: who claimed which entry, until when.

``ReservationBook`` holds the open reservations (by id and by request, in
order), their leases, and tombstones of removed ones, so that a late push is
answered precisely (expired, cancelled, a repeat) rather than "unknown". It
knows nothing of entries: ``EmbeddingCache`` (``embedding_cache.py``) keeps
each entry's set of reservation ids and calls in here to add and remove.

Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from collections.abc import ItemsView

from services.pd.engine.embedding_records import (
    AlreadyFilled,
    LeaseExpired,
    Reservation,
    ReservationKind,
    ReservationNotFound,
    ReservationRejected,
    Tombstone,
)
from services.pd.engine.invariants import check
from services.pd.engine.leases import LeaseQueue

_MAX_TOMBSTONES = 4096  # remembered removed reservation ids, to tell "late" from "unknown"


class ReservationBook:
    """Open reservations, indexed by id and by request, with their leases and the tombstones of removed ones."""

    def __init__(self) -> None:
        self._open: dict[str, Reservation] = {}
        self._by_request: dict[str, dict[str, None]] = {}  # request -> ids, in order
        self._leases = LeaseQueue()  # of reservation ids: expiry pops only what ended
        self._tombstones: OrderedDict[str, Tombstone] = OrderedDict()  # removed reservations
        # A per-instance prefix: ids from before a restart never match new ones.
        self._id_prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._open)

    def __getitem__(self, reservation_id: str) -> Reservation:
        return self._open[reservation_id]

    def items(self) -> ItemsView[str, Reservation]:
        return self._open.items()

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` holds any open reservation."""
        return request_id in self._by_request

    def of_request(self, request_id: str) -> list[Reservation]:
        """The request's open reservations, in the order they were made."""
        return [self._open[rid] for rid in self._by_request.get(request_id, ())]

    def add(self, request_id: str, mm_hash: str, kind: ReservationKind, lease_deadline: float, num_tokens: int) -> str:
        """Open a reservation under a new id (returned), its lease queued."""
        reservation_id = f"{self._id_prefix}-{next(self._ids)}"
        self._open[reservation_id] = Reservation(reservation_id, request_id, mm_hash, lease_deadline, kind, num_tokens)
        self._by_request.setdefault(request_id, {})[reservation_id] = None
        self._leases.push(lease_deadline, reservation_id)
        return reservation_id

    def remove(self, reservation: Reservation, why: str) -> None:
        """Close an open reservation, remembering ``why`` for a push that arrives later."""
        rid = reservation.reservation_id
        del self._open[rid]
        ids = self._by_request[reservation.request_id]
        del ids[rid]
        if not ids:
            del self._by_request[reservation.request_id]
        self._tombstones[rid] = Tombstone(
            why, reservation.request_id, reservation.mm_hash, reservation.num_tokens, reservation.filled
        )
        if len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def ended(self, now: float) -> list[Reservation]:
        """Open reservations whose lease ended before ``now``, earliest first (still open: the caller removes them)."""
        live = self._leases.pop_ended(now, lambda rid, _deadline: rid in self._open)
        return [self._open[rid] for rid in live]

    def live_push(self, request_id: str, reservation_id: str, mm_hash: str, now: float) -> Reservation:
        """The open, unfilled PUSH reservation a push names; raises ReservationNotFound (never issued here),
        LeaseExpired, AlreadyFilled (a repeat of a push that landed, or one its request no longer needed)
        or ReservationRejected (cancelled, a pin, or not matching)."""
        reservation = self._open.get(reservation_id)
        if reservation is None:
            tombstone = self._tombstones.get(reservation_id)
            if tombstone is None:
                raise ReservationNotFound("unknown reservation")
            moot = tombstone.filled or tombstone.why in ("served", "not needed")
            if moot and (tombstone.request_id, tombstone.mm_hash) == (request_id, mm_hash):
                raise AlreadyFilled(tombstone.num_tokens)
            if tombstone.why == "lease expired":
                raise LeaseExpired("reservation lease expired")
            raise ReservationRejected(f"reservation {tombstone.why}")
        if reservation.request_id != request_id or reservation.mm_hash != mm_hash:
            raise ReservationRejected("request id or mm_hash does not match the reservation")
        if reservation.kind is not ReservationKind.PUSH:
            raise ReservationRejected("reservation is a pin, not a push target")
        if reservation.filled:
            raise AlreadyFilled(reservation.num_tokens)
        if now > reservation.lease_deadline:
            raise LeaseExpired("reservation lease expired")
        return reservation

    def check_integrity(self) -> None:
        """Raise AssertionError unless the request index matches the open reservations."""
        for rid, reservation in self._open.items():
            check(rid in self._by_request.get(reservation.request_id, ()), "request index")
        check(sum(len(ids) for ids in self._by_request.values()) == len(self._open), "request index has stale ids")

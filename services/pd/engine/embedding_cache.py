"""Bookkeeping of the PD's image-embedding cache, with two-step allocation.

Tensors live in the engine core, keyed by ``mm_hash``; this class decides what
may be stored, what must stay and what goes. Every call that removes entries
returns their hashes (``Preallocation.evicted``, ``ExpiryResult.dropped_hashes``,
``cancel_request``), and the core drops those tensors. Capacity is counted in
embedding rows (tokens).

Life of an entry: ``preallocate`` creates it RESERVED with a PUSH reservation
(a lease); the encoder's push ``fill``s it and it becomes READY. Requests hold
references (``take_over`` / ``acquire`` ... ``release``); reservations (PUSH or
PIN) also keep an entry. Only READY entries with neither are evictable, LRU
first. A RESERVED entry always has at least one unfilled PUSH reservation: when
its last one goes away unfilled (lease, cancel), the entry is dropped and
whoever waits on it must be failed (``expire`` reports the hashes).

The reservations themselves, their leases and the tombstones of removed ones
are kept by a ``ReservationBook`` (``embedding_reservations.py``).

Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.pd.engine.cache_events import CacheEventRecorder
from services.pd.engine.embedding_records import (
    AlreadyFilled,
    CacheEntry,
    EmbeddingCacheFull,
    EmbeddingCacheStats,
    EntryState,
    ExpiryResult,
    Preallocation,
    Reservation,
    ReservationKind,
    ReservationRejected,
    item_sizes,
)
from services.pd.engine.embedding_reservations import ReservationBook
from services.pd.engine.invariants import check


class EmbeddingCache:
    """Token-bounded cache of image embeddings keyed by ``mm_hash`` (bookkeeping only)."""

    def __init__(
        self, capacity_tokens: int, retry_after_s: float = 1.0, events: CacheEventRecorder | None = None
    ) -> None:
        """``events`` hears of every entry that becomes READY or is evicted (the proxies' cache-aware routing)."""
        if capacity_tokens <= 0:
            raise ValueError("capacity_tokens must be positive")
        self.capacity_tokens = capacity_tokens
        self.retry_after_s = retry_after_s
        self._entries: dict[str, CacheEntry] = {}
        self._evictable: OrderedDict[str, None] = OrderedDict()  # READY, unreferenced; LRU first
        self._evictable_tokens = 0
        self._used_tokens = 0
        self._reservations = ReservationBook()
        self.events = events or CacheEventRecorder()

    # ------------------------------------------------------------------ queries
    def is_ready(self, mm_hash: str) -> bool:
        entry = self._entries.get(mm_hash)
        return entry is not None and entry.state is EntryState.READY

    def state(self, mm_hash: str) -> EntryState | None:
        """The entry's state, or None when absent."""
        entry = self._entries.get(mm_hash)
        return None if entry is None else entry.state

    def num_tokens(self, mm_hash: str) -> int:
        """Rows of the entry (0 when absent)."""
        entry = self._entries.get(mm_hash)
        return 0 if entry is None else entry.num_tokens

    def ref_count(self, mm_hash: str) -> int:
        """References held on the entry (0 when absent)."""
        entry = self._entries.get(mm_hash)
        return 0 if entry is None else entry.ref_count

    def ready_entries(self) -> list[tuple[str, int]]:
        """``(mm_hash, rows)`` of every READY entry (a cache-event snapshot)."""
        return [(h, e.num_tokens) for h, e in self._entries.items() if e.state is EntryState.READY]

    def awaits_push(self) -> bool:
        """Whether an entry is RESERVED: an encoder is, or will be, working on an image for this PD."""
        return any(entry.state is EntryState.RESERVED for entry in self._entries.values())

    def has_reservations(self, request_id: str) -> bool:
        """Whether ``request_id`` holds any open reservation."""
        return self._reservations.has_request(request_id)

    def stats(self) -> EmbeddingCacheStats:
        """Row counts by state, entries and open reservations, at this moment."""
        reserved = sum(e.num_tokens for e in self._entries.values() if e.state is EntryState.RESERVED)
        return EmbeddingCacheStats(
            capacity_tokens=self.capacity_tokens,
            used_tokens=self._used_tokens,
            reserved_tokens=reserved,
            ready_tokens=self._used_tokens - reserved,
            evictable_tokens=self._evictable_tokens,
            num_entries=len(self._entries),
            num_reservations=len(self._reservations),
        )

    # ------------------------------------------------------------- admission
    def preallocate(
        self, request_id: str, items: Sequence[tuple[str, int]], lease_deadline: float, now: float
    ) -> Preallocation:
        """Claim every item of a request, all or nothing.

        Per item, in order, ``Preallocation.items`` holds ``(mm_hash, state,
        reservation_id)``; ``Preallocation.evicted`` the READY entries evicted to
        make room (the caller drops their tensors). READY
        items get a PIN (kept until ``take_over`` or the lease ends); RESERVED
        items get a PUSH reservation, joining a pending entry if another request
        already reserved it (no extra room). A hash repeated in ``items`` maps to
        one reservation. Raises ``EmbeddingCacheFull`` (nothing changed) when the
        new entries do not fit even after eviction, and ValueError on a
        ``num_tokens`` mismatch, a lease not after ``now``, or items that could
        never fit.
        """
        if lease_deadline <= now:
            raise ValueError("lease_deadline must be after now")
        sizes = item_sizes(items, self._entries)
        if sum(sizes.values()) > self.capacity_tokens:
            raise ValueError("items exceed the embedding cache capacity")
        new_tokens = sum(n for h, n in sizes.items() if h not in self._entries)
        # Entries this request is about to pin stop being evictable.
        pinned_evictable = sum(n for h, n in sizes.items() if h in self._evictable)
        if new_tokens > self._num_available_tokens() - pinned_evictable:
            raise EmbeddingCacheFull(self.retry_after_s)
        answers: dict[str, tuple[str, EntryState, str]] = {}
        for mm_hash in sizes:  # existing entries first: protect them
            entry = self._entries.get(mm_hash)
            if entry is not None:
                kind = ReservationKind.PIN if entry.state is EntryState.READY else ReservationKind.PUSH
                answers[mm_hash] = self._add_reservation(request_id, entry, kind, lease_deadline)
        evicted = self._evict_until(new_tokens)
        for mm_hash, num_tokens in sizes.items():
            if mm_hash not in answers:
                entry = CacheEntry(mm_hash, num_tokens, EntryState.RESERVED)
                self._entries[mm_hash] = entry
                self._used_tokens += num_tokens
                answers[mm_hash] = self._add_reservation(request_id, entry, ReservationKind.PUSH, lease_deadline)
        return Preallocation([answers[mm_hash] for mm_hash, _ in items], evicted)

    # ------------------------------------------------------------------ pushes
    def check_push(
        self, request_id: str, reservation_id: str, mm_hash: str, num_tokens: int, now: float
    ) -> Reservation:
        """Validate a push header against its reservation (before reading bytes).

        Raises ReservationNotFound for an id never issued here, LeaseExpired
        for an expired one, AlreadyFilled for a repeat of a push that landed
        (same request, image and size), and ReservationRejected for a
        cancelled, pinned or mismatched one.
        """
        try:
            reservation = self._reservations.live_push(request_id, reservation_id, mm_hash, now)
        except AlreadyFilled as repeat:
            if num_tokens != repeat.num_tokens:
                raise ReservationRejected("embedding size does not match the reservation") from None
            raise
        if num_tokens != reservation.num_tokens:
            raise ReservationRejected("embedding size does not match the reservation")
        return reservation

    def fill(self, request_id: str, reservation_id: str, mm_hash: str, now: float) -> bool:
        """Mark a validated push as received.

        True: the entry just became READY (the engine keeps the tensor). False:
        it was already READY (duplicate push; the engine drops the tensor).
        Raises like ``check_push``.
        """
        reservation = self._reservations.live_push(request_id, reservation_id, mm_hash, now)
        entry = self._entries[mm_hash]
        reservation.filled = True
        became_ready = entry.state is EntryState.RESERVED
        entry.state = EntryState.READY
        if became_ready:
            self.events.embedding_stored(mm_hash, entry.num_tokens)
        if reservation.end_on_fill:
            self._remove_reservation(reservation, "already filled")
        self._touch(entry)
        return became_ready

    # ------------------------------------------------------------- references
    def take_over(self, request_id: str) -> list[str]:
        """Generate arrived: turn the request's reservations into references.

        One reference per distinct mm_hash (returned). Filled PUSH and PIN
        reservations end; unfilled PUSH ones stay live under their lease until
        filled or expired (the entry keeps waiting for that push).
        """
        taken: list[str] = []
        for reservation in self._reservations.of_request(request_id):
            if reservation.end_on_fill:
                continue  # already taken over (or orphaned): no second reference
            entry = self._entries[reservation.mm_hash]
            if reservation.mm_hash not in taken:
                taken.append(reservation.mm_hash)
                entry.ref_count += 1
            if reservation.kind is ReservationKind.PUSH and not reservation.filled:
                reservation.end_on_fill = True
            else:
                why = "already filled" if reservation.filled else "taken over"
                self._remove_reservation(reservation, why)
            self._touch(entry)
        return taken

    def acquire(self, mm_hash: str) -> bool:
        """Add a reference to an existing entry (READY, or RESERVED awaiting a push).

        For a request that has no reservation for it (Generate without
        Preallocate, or a resumed request). False when the entry is absent.
        """
        entry = self._entries.get(mm_hash)
        if entry is None:
            return False
        entry.ref_count += 1
        self._touch(entry)
        return True

    def release(self, mm_hash: str) -> None:
        """Drop one reference. Callers release each reference they hold exactly
        once; releasing an absent (dropped) entry is a no-op."""
        entry = self._entries.get(mm_hash)
        if entry is None or entry.ref_count == 0:
            return
        entry.ref_count -= 1
        self._touch(entry)

    # -------------------------------------------------------- cancel / expire
    def cancel_request(self, request_id: str, served: bool = False) -> list[str]:
        """Drop a finished request's reservations and pins; returns the hashes removed.

        ``served``: the request finished with its answer (its prompt's KV came from the
        prefix cache, so a push it reserved never had to land): a late push to it is then
        taken and dropped, as a repeat is, rather than refused (its encoder call succeeds).

        Call after releasing the request's own references. RESERVED entries
        nobody else needs go away (room freed). The last pending push of an
        entry that others still reference is kept under its lease (and ends
        when filled), so the encoder's push can still land for them. A push
        still on its way for a request that was served from another request's
        push (its entry READY) is answered like a repeat (``AlreadyFilled``).
        """
        removed: list[str] = []
        for reservation in self._reservations.of_request(request_id):
            entry = self._entries[reservation.mm_hash]
            if (
                entry.state is EntryState.RESERVED
                and entry.ref_count > 0
                and not reservation.filled
                and self._num_pushes(entry) == 1
                and reservation.kind is ReservationKind.PUSH
            ):
                reservation.end_on_fill = True
                continue
            # A request that took its reservation over and ends with the entry READY was served by
            # another request's push; one that finished with its answer never needed its push. Either
            # way the push, arriving now, carries nothing new and is no failure.
            if reservation.end_on_fill and entry.state is EntryState.READY:
                why = "served"
            elif served and reservation.kind is ReservationKind.PUSH and not reservation.filled:
                why = "not needed"
            else:
                why = "cancelled"
            self._remove_reservation(reservation, why)
            if self._drop_if_orphaned(entry):
                removed.append(entry.mm_hash)
        return removed

    def expire(self, now: float) -> ExpiryResult:
        """Remove reservations whose lease ended before ``now``.

        A RESERVED entry left without a pending push is dropped even if
        referenced: its hash is in ``dropped_hashes`` and the requests waiting
        on it must be failed.
        """
        expired = self._reservations.ended(now)
        dropped: list[str] = []
        for reservation in expired:
            self._remove_reservation(reservation, "lease expired")
            entry = self._entries.get(reservation.mm_hash)
            if entry is not None and self._drop_if_orphaned(entry):
                dropped.append(entry.mm_hash)
        return ExpiryResult(expired, dropped)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent."""
        check(self._used_tokens == sum(e.num_tokens for e in self._entries.values()), "used tokens differ from entries")
        check(self._used_tokens <= self.capacity_tokens, "over capacity")
        evictable = [h for h, e in self._entries.items() if self._is_evictable(e)]
        check(set(evictable) == set(self._evictable), "evictable set out of date")
        check(
            self._evictable_tokens == sum(self._entries[h].num_tokens for h in evictable),
            "evictable tokens out of date",
        )
        for entry in self._entries.values():
            check(entry.ref_count >= 0, "negative ref count")
            for rid in entry.reservation_ids:
                check(self._reservations[rid].mm_hash == entry.mm_hash, "reservation index")
            if entry.state is EntryState.RESERVED:
                check(self._num_pushes(entry) > 0, "RESERVED entry without a pending push")
        for rid, reservation in self._reservations.items():
            check(rid in self._entries[reservation.mm_hash].reservation_ids, "entry index")
        self._reservations.check_integrity()

    # ---------------------------------------------------------------- helpers
    def _num_available_tokens(self) -> int:
        return self.capacity_tokens - self._used_tokens + self._evictable_tokens

    def _evict_until(self, num_tokens: int) -> list[str]:
        """Evicts least recently used READY entries until ``num_tokens`` rows are free."""
        evicted = []
        while self.capacity_tokens - self._used_tokens < num_tokens:
            mm_hash, _ = self._evictable.popitem(last=False)
            entry = self._entries.pop(mm_hash)
            self._evictable_tokens -= entry.num_tokens
            self._used_tokens -= entry.num_tokens
            evicted.append(mm_hash)
            self.events.embedding_removed(mm_hash)
        return evicted

    def _add_reservation(
        self, request_id: str, entry: CacheEntry, kind: ReservationKind, lease_deadline: float
    ) -> tuple[str, EntryState, str]:
        reservation_id = self._reservations.add(request_id, entry.mm_hash, kind, lease_deadline, entry.num_tokens)
        entry.reservation_ids.add(reservation_id)
        self._touch(entry)
        return entry.mm_hash, entry.state, reservation_id

    def _remove_reservation(self, reservation: Reservation, why: str) -> None:
        self._reservations.remove(reservation, why)
        entry = self._entries.get(reservation.mm_hash)
        if entry is not None:
            entry.reservation_ids.discard(reservation.reservation_id)
            self._touch(entry)

    def _num_pushes(self, entry: CacheEntry) -> int:
        return sum(
            1
            for rid in entry.reservation_ids
            if self._reservations[rid].kind is ReservationKind.PUSH and not self._reservations[rid].filled
        )

    def _drop_if_orphaned(self, entry: CacheEntry) -> bool:
        """Remove a RESERVED entry that no push can fill any more."""
        if entry.state is not EntryState.RESERVED or self._num_pushes(entry) > 0:
            return False
        for rid in list(entry.reservation_ids):  # pins cannot exist on RESERVED; be safe
            self._remove_reservation(self._reservations[rid], "cancelled")
        del self._entries[entry.mm_hash]
        self._used_tokens -= entry.num_tokens
        return True

    @staticmethod
    def _is_evictable(entry: CacheEntry) -> bool:
        return entry.state is EntryState.READY and entry.ref_count == 0 and not entry.reservation_ids

    def _touch(self, entry: CacheEntry) -> None:
        """Re-file the entry after a change; a use makes it most recently used."""
        if entry.mm_hash in self._evictable:
            del self._evictable[entry.mm_hash]
            self._evictable_tokens -= entry.num_tokens
        if self._is_evictable(entry) and self._entries.get(entry.mm_hash) is entry:
            self._evictable[entry.mm_hash] = None
            self._evictable_tokens += entry.num_tokens

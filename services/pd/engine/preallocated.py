"""What a Preallocate leaves for the Generate that follows it. Pure Python.

Preallocate looks up the prompt's cached prefix once (the lookup pins the
blocks under the request id) and answers READY for every image inside it.
Generate then takes that same prefix over, if its prompt is the one
Preallocate saw. Until then the prefix is held under a lease; a lease that
runs out unpins it, and its request id is remembered (a bounded number of
them) so a late Generate is told its lease expired rather than that it never
preallocated.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from services.pd.engine.request import Request

EXPIRED_MEMORY = 4096
"""Request ids whose lease ran out, remembered so a late Generate hears DEADLINE_EXCEEDED (bounded)."""


@dataclass
class Preallocated:
    """One Preallocate not yet followed by its Generate."""

    probe: Request  # the prompt and spans Preallocate saw, with their cached prefix and block hashes
    deadline: float  # monotonic seconds
    covers_images: bool  # some item was answered READY because its K/V is in the prefix

    def matches(self, request: Request) -> bool:
        """Whether ``request`` is the prompt this Preallocate looked up."""
        return request.prompt_token_ids == self.probe.prompt_token_ids and request.mm_spans == self.probe.mm_spans


class PreallocatedRequests:
    """Preallocations by request id, and the ids whose lease expired. Not thread-safe."""

    def __init__(self) -> None:
        self._pending: dict[str, Preallocated] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
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
        ended = [p for p in self._pending.values() if p.deadline < now]
        for preallocated in ended:
            del self._pending[preallocated.probe.request_id]
        self.remember_expired(p.probe.request_id for p in ended)
        return ended

    def remember_expired(self, request_ids: Iterable[str]) -> None:
        """Records ids whose lease (of a prefix or an image reservation) ran out."""
        for request_id in request_ids:
            self._expired[request_id] = None
            self._expired.move_to_end(request_id)
        while len(self._expired) > EXPIRED_MEMORY:
            self._expired.popitem(last=False)

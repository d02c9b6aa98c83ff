"""Lease deadlines in a min-heap: expiring leases costs only the leases that ended. Pure Python."""

from __future__ import annotations

import heapq
from collections.abc import Callable


class LeaseQueue:
    """``(deadline, key)`` pairs, earliest first.

    A lease ended early (taken over, cancelled) is not searched for: it stays
    until its deadline passes, and ``pop_ended`` skips it when ``is_live``
    says so. Memory is bounded by the leases granted within one lease length.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def push(self, deadline: float, key: str) -> None:
        heapq.heappush(self._heap, (deadline, key))

    def pop_ended(self, now: float, is_live: Callable[[str, float], bool]) -> list[str]:
        """Keys whose deadline is before ``now`` and that ``is_live(key, deadline)`` still holds, earliest first."""
        ended = []
        while self._heap and self._heap[0][0] < now:
            deadline, key = heapq.heappop(self._heap)
            if is_live(key, deadline):
                ended.append(key)
        return ended

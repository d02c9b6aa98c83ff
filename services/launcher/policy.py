"""When ``epd up`` restarts a child, and when it gives up: the pure policy half of supervision.

``RestartPolicy`` and ``CrashHistory`` decide the backoff before a restart
or declare a crash loop, from the clock alone; ``HealthPolicy`` says how a
running child is checked by RPC; ``CrashLoop`` is the report of a service
left down. ``supervisor.py`` applies them to processes.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited is started again."""

    max_restarts: int = 5
    """Restarts of one service allowed within ``window_s``; one more exit is a crash loop (0 = never restart)."""
    window_s: float = 60.0
    """Sliding window over which restarts are counted."""
    backoff_s: float = 1.0
    """Delay before the first restart in a window; doubles with each further one."""
    max_backoff_s: float = 30.0
    """Longest delay between an exit and its restart."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("max_restarts >= 0, window_s > 0 and 0 <= backoff_s <= max_backoff_s are required")


class CrashHistory:
    """One service's recent restarts; decides the next delay or declares a crash loop (pure)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._restarts: deque[float] = deque()

    @property
    def num_recent(self) -> int:
        """Restarts inside the window at the last ``on_exit``."""
        return len(self._restarts)

    def on_exit(self, now: float) -> float | None:
        """The delay before restarting a child that exited at ``now``; None = crash loop, stop."""
        while self._restarts and now - self._restarts[0] > self.policy.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.policy.max_restarts:
            return None
        self._restarts.append(now)
        return min(self.policy.backoff_s * 2 ** (len(self._restarts) - 1), self.policy.max_backoff_s)


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` or ``killed by SIGKILL`` (Popen reports a signal as a negative code)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class HealthPolicy:
    """How a running child is checked by RPC, so that a hung one (SIGSTOP, a wedged loop) is restarted.

    A child is alive when it answers its liveness RPC (gRPC health ``""``;
    the proxy: any answer to HTTP ``/health``) within ``timeout_s``. A live
    process that fails ``max_failures`` checks in a row is killed (SIGKILL,
    which a stopped process cannot ignore) and restarted like one that exited.
    """

    interval_s: float = 2.0
    """Time between the end of one check of a child and the start of the next."""
    timeout_s: float = 2.0
    """A check not answered within this long failed."""
    max_failures: int = 3
    """Consecutive failed checks that get a child killed and restarted (0 = never)."""

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.max_failures < 0:
            raise ValueError("health interval and timeout > 0 and max_failures >= 0 are required")


@dataclass(frozen=True)
class CrashLoop:
    """A service that crash-looped: the service, how it last exited, its last output lines."""

    name: str
    exit: str
    num_restarts: int
    window_s: float
    tail: list[str]

    def message(self, stopping: bool = True) -> str:
        """The log line; ``stopping``: the whole cluster stops, else only this service stays down."""
        lines = "".join(f"\n  | {line}" for line in self.tail) or "\n  (no output)"
        outcome = "stopping the cluster" if stopping else "it stays down, the others keep serving"
        return (
            f"{self.name} is crash-looping: it {self.exit} after {self.num_restarts} restarts within "
            f"{self.window_s:.0f}s; {outcome}. Its last output lines:{lines}"
        )

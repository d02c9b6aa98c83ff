"""Watchdog: a service's readiness and liveness follow its worker thread.

A wedged worker thread (PD's engine loop, the encoder's vision batcher: a
hung device call, a deadlock) leaves the gRPC server up and answering health
checks as if all were well, while every request waits forever. The watchdog
reads the worker's ``stalled_for()`` (seconds without progress while work is
pending) and ``is_alive``:

- readiness (the service's own health name): off once the worker has been
  stuck for the readiness probe's timeout, on again as soon as it moves; the
  proxy routes around;
- liveness (the health service ``""``): off once it has been stuck for the
  liveness probe's timeout (an orchestrator, or ``epd up``, restarts it), or
  for good when the thread has died;
- a dead thread also calls ``on_dead`` once (``epd pd`` then exits non-zero,
  and ``epd up`` restarts it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from grpc_health.v1 import health_pb2

from services.common import grpc_utils

log = logging.getLogger(__name__)

SetStatus = Callable[[bool], Awaitable[None]]


class Watched(Protocol):
    """A worker thread the watchdog looks at."""

    @property
    def is_alive(self) -> bool: ...

    def stalled_for(self) -> float:
        """Seconds without progress while work is pending (0 = healthy or idle)."""
        ...


def check_interval(timeout_s: float) -> float:
    """How often to look: often enough to notice within ~25% of the timeout, at most 1 s."""
    return max(0.01, min(1.0, timeout_s / 4))


@dataclass(frozen=True)
class Probe:
    """One health status the watchdog keeps: ``set_status(ok)`` when ``ok`` changes."""

    name: str  # for logs: "ready" / "alive"
    set_status: SetStatus
    timeout_s: float  # stuck this long (with work pending) = not ok; 0 = only a dead thread counts


async def watch_engine(
    engine: Watched,
    probes: list[Probe],
    on_dead: Callable[[], None] | None = None,
    interval_s: float | None = None,
) -> None:
    """Runs until cancelled; assumes every probe reports ok when it starts."""
    timeouts = [p.timeout_s for p in probes if p.timeout_s > 0]
    interval = check_interval(min(timeouts, default=4.0)) if interval_s is None else interval_s
    ok = [True] * len(probes)
    dead_reported = False
    while True:
        await asyncio.sleep(interval)
        alive, stalled_s = engine.is_alive, engine.stalled_for()
        for index, probe in enumerate(probes):
            healthy = alive and (probe.timeout_s <= 0 or stalled_s <= probe.timeout_s)
            if healthy != ok[index]:
                ok[index] = healthy
                _log_change(probe.name, healthy, alive, stalled_s)
                await probe.set_status(healthy)
        if not alive and not dead_reported:
            dead_reported = True
            if on_dead is not None:
                on_dead()


async def watch_readiness(
    engine: Watched, set_ready: SetStatus, timeout_s: float, interval_s: float | None = None
) -> None:
    """Readiness only (see the module docstring)."""
    await watch_engine(engine, [Probe("ready", set_ready, timeout_s)], interval_s=interval_s)


def _log_change(name: str, healthy: bool, alive: bool, stalled_s: float) -> None:
    if healthy:
        log.warning("worker thread is moving again: %s", name)
    elif alive:
        log.error("worker thread made no progress for %.1fs with work pending: not %s", stalled_s, name)
    else:
        log.error("worker thread is not running: not %s", name)


async def set_alive(server: grpc_utils.GrpcServer, alive: bool) -> None:
    """Liveness: the health service ``""`` of ``server``."""
    status = health_pb2.HealthCheckResponse.SERVING if alive else health_pb2.HealthCheckResponse.NOT_SERVING
    await server.health.set("", status)

"""Engine watchdog: readiness and liveness of PD follow its engine thread.

A wedged engine thread (a hung device call, a deadlock) leaves the gRPC server
up and answering health checks as if all were well, while every request
waits forever. The watchdog reads ``EngineBridge.stalled_for()`` (seconds
without progress while work is pending) and ``is_alive``:

- readiness (``epd.v1.PrefillDecode``): off once the loop has been stuck for
  ``stall_timeout_s``, on again as soon as it moves; the proxy routes around;
- liveness (the health service ``""``): off once the loop has been stuck for
  ``liveness_timeout_s`` (an orchestrator restarts the pod), or for good when
  the engine thread has died;
- a dead engine thread also calls ``on_dead`` once (``epd pd`` then exits
  non-zero, and ``epd up`` restarts it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.pd.bridge import EngineBridge

log = logging.getLogger(__name__)

SetStatus = Callable[[bool], Awaitable[None]]


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
    engine: EngineBridge,
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
    engine: EngineBridge, set_ready: SetStatus, timeout_s: float, interval_s: float | None = None
) -> None:
    """Readiness only (see the module docstring)."""
    await watch_engine(engine, [Probe("ready", set_ready, timeout_s)], interval_s=interval_s)


def _log_change(name: str, healthy: bool, alive: bool, stalled_s: float) -> None:
    if healthy:
        log.warning("engine step loop is moving again: %s", name)
    elif alive:
        log.error("engine step loop made no progress for %.1fs with work pending: not %s", stalled_s, name)
    else:
        log.error("engine thread is not running: not %s", name)

"""Readiness watchdog: PD reports NOT_SERVING while its step loop is stuck.

A wedged engine thread (a hung device call, a deadlock) leaves the gRPC server
up and answering health checks as if all were well, while every request
waits forever. The watchdog reads ``EngineBridge.stalled_for()`` (seconds without
progress while work is pending) and flips the ready status of
``epd.v1.PrefillDecode``: off once it passes ``timeout_s``, on again as soon as
the loop moves. A dead engine thread is never ready. The proxy's health
polling then routes around the PD.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.pd.bridge import EngineBridge

log = logging.getLogger(__name__)


def check_interval(timeout_s: float) -> float:
    """How often to look: often enough to notice within ~25% of the timeout, at most 1 s."""
    return max(0.01, min(1.0, timeout_s / 4))


async def watch_readiness(
    engine: EngineBridge,
    set_ready: Callable[[bool], Awaitable[None]],
    timeout_s: float,
    interval_s: float | None = None,
) -> None:
    """Runs until cancelled; assumes the server is ready when it starts."""
    interval = check_interval(timeout_s) if interval_s is None else interval_s
    ready = True
    while True:
        await asyncio.sleep(interval)
        stalled_s = engine.stalled_for()
        healthy = engine.is_alive and stalled_s <= timeout_s
        if healthy == ready:
            continue
        ready = healthy
        if healthy:
            log.warning("engine step loop is moving again: ready")
        elif engine.is_alive:
            log.error("engine step loop made no progress for %.1fs with work pending: not ready", stalled_s)
        else:
            log.error("engine thread is not running: not ready")
        await set_ready(healthy)

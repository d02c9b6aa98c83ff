"""The readiness watchdog against an engine double: flips only on changes."""

from __future__ import annotations

import asyncio

from services.common.watchdog import check_interval, watch_readiness


class FakeEngine:
    def __init__(self) -> None:
        self.stalled_s = 0.0
        self.is_alive = True

    def stalled_for(self) -> float:
        return self.stalled_s


async def test_watchdog_reports_stalls_recoveries_and_a_dead_engine():
    engine = FakeEngine()
    reports: list[bool] = []

    async def set_ready(ready: bool) -> None:
        reports.append(ready)

    async def settle() -> None:
        await asyncio.sleep(0.05)

    task = asyncio.create_task(watch_readiness(engine, set_ready, timeout_s=1.0, interval_s=0.005))
    await settle()
    assert reports == []  # healthy: nothing to report
    engine.stalled_s = 0.9
    await settle()
    assert reports == []  # slow, but within the timeout
    engine.stalled_s = 1.5
    await settle()
    assert reports == [False]  # reported once, not on every check
    engine.stalled_s = 0.0
    await settle()
    assert reports == [False, True]
    engine.is_alive = False
    await settle()
    assert reports == [False, True, False]
    task.cancel()


def test_check_interval_is_a_quarter_of_the_timeout_at_most_a_second():
    assert check_interval(60.0) == 1.0
    assert check_interval(0.5) == 0.125
    assert check_interval(0.0) == 0.01

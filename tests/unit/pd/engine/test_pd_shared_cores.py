"""A PD beside an encoder (services/pd/shared_cores.py): before each step the engine thread asks for sleeping
OpenMP workers while an image it reserved room for is awaited, and for spinning ones otherwise."""

from __future__ import annotations

import asyncio

from core_support import FakeClock, make_core

from services.pd import shared_cores
from services.pd.bridge import EngineBridge


class RecordingWorkers:
    """Test double of ``openmp.SleepingWorkers`` (tested in tests/unit/common/test_openmp.py): records asks."""

    def __init__(self, owner_alive) -> None:
        self.owner_alive = owner_alive
        self.asked: list[bool] = []

    def set(self, sleep: bool) -> None:
        self.asked.append(sleep)


async def _iterations(bridge: EngineBridge, count: int) -> None:
    for _ in range(count):  # a command is one loop iteration: commands, the pre-step hooks, a step, the hooks
        await bridge.call(lambda: None)
    await asyncio.sleep(0.05)


def _recorded_bridge(monkeypatch, awaited: list[bool]) -> tuple[EngineBridge, list[str]]:
    monkeypatch.setattr(shared_cores.openmp, "SleepingWorkers", RecordingWorkers)
    bridge = EngineBridge(make_core(clock=FakeClock(), num_blocks=64, block_size=4))
    order: list[str] = []

    def awaits_push() -> bool:
        order.append("asked")
        return awaited[0]

    step = bridge.core.step

    def recorded_step():
        order.append("step")
        return step()

    monkeypatch.setattr(bridge.core.scheduler.embedding_cache, "awaits_push", awaits_push)
    monkeypatch.setattr(bridge.core, "step", recorded_step)
    return bridge, order


async def test_the_engine_asks_before_each_step_and_follows_the_awaited_images(monkeypatch):
    awaited = [True]
    bridge, order = _recorded_bridge(monkeypatch, awaited)
    workers = shared_cores.yield_cores_to_encoder(bridge)
    bridge.start()
    try:
        assert workers.owner_alive()
        await _iterations(bridge, 2)
        assert order[:2] == ["asked", "step"]
        assert set(workers.asked) == {True}
        awaited[0] = False
        await _iterations(bridge, 2)
        assert workers.asked[-1] is False
    finally:
        bridge.shutdown()
    assert not workers.owner_alive()  # the real switch ends its spare team and thread then

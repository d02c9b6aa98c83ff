"""A PD beside an encoder (services/pd/shared_cores.py): before each step the engine thread asks for sleeping
OpenMP workers while an image it reserved room for is awaited, and for spinning ones otherwise; meanwhile it
holds its steps until the image comes, never a step with a text-only prompt to prefill."""

from __future__ import annotations

import asyncio
import time

import pytest
from core_support import FakeClock, make_core
from scheduler_harness import IMG

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


def _recorded_bridge(monkeypatch, awaited: list[bool], clock=None) -> tuple[EngineBridge, list[str]]:
    monkeypatch.setattr(shared_cores.openmp, "SleepingWorkers", RecordingWorkers)
    bridge = EngineBridge(make_core(clock=clock or FakeClock(), num_blocks=64, block_size=4))
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
    workers = shared_cores.yield_cores_to_encoder(bridge, max_hold_period_s=0.0)
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


def _held_bridge(
    monkeypatch, awaited: list[bool], ready: list[bool], clock=None, **hold
) -> tuple[EngineBridge, list[str]]:
    bridge, order = _recorded_bridge(monkeypatch, awaited, clock)
    monkeypatch.setattr(shared_cores, "has_text_prompt_ready", lambda scheduler: ready[0])
    shared_cores.yield_cores_to_encoder(bridge, **hold)
    return bridge, order


def _image_arrived(awaited: list[bool], ready: list[bool]) -> None:
    awaited[0] = False


def _text_prompt_arrived(awaited: list[bool], ready: list[bool]) -> None:
    ready[0] = True


@pytest.mark.parametrize("release", [_image_arrived, _text_prompt_arrived])
async def test_steps_are_held_while_an_image_is_awaited_until_it_or_a_text_prompt_comes(monkeypatch, release):
    awaited, ready = [True], [False]
    bridge, order = _held_bridge(monkeypatch, awaited, ready, max_hold_period_s=30.0)
    bridge.start()
    try:
        await _iterations(bridge, 3)  # each command is answered during the hold
        assert "step" not in order
        release(awaited, ready)
        await _iterations(bridge, 1)
        assert "step" in order
    finally:
        bridge.shutdown()


async def test_the_hold_ends_after_its_period_though_the_image_never_came(monkeypatch):
    awaited, ready = [True], [False]
    bridge, order = _held_bridge(monkeypatch, awaited, ready, max_hold_period_s=0.3)
    bridge.start()
    try:
        started = time.monotonic()
        while "step" not in order and time.monotonic() - started < 10.0:
            await _iterations(bridge, 1)
        assert "step" in order and awaited[0]
    finally:
        bridge.shutdown()


def test_only_a_text_only_prompt_releases_the_hold(h):
    assert not shared_cores.has_text_prompt_ready(h.sched)
    image = h.add("i", [4] + [IMG] * 8 + [5], spans=[("cat", 1, 8)])
    assert not shared_cores.has_text_prompt_ready(h.sched)  # it waits for its image with the held steps
    text = h.add("t", [1, 2, 3], max_tokens=4)
    assert shared_cores.has_text_prompt_ready(h.sched)  # queued, not yet started
    h.step()
    assert text.is_decoding and not shared_cores.has_text_prompt_ready(h.sched)
    h.push("i", "cat")
    assert not shared_cores.has_text_prompt_ready(h.sched)  # its prompt is not text-only
    h.run()
    assert image.is_finished and text.is_finished


def test_a_prompt_held_for_its_image_counts_as_waiting_for_it_until_the_image_comes(h):
    queued = h.add("q", [4, 5] + [IMG] * 8 + [6], spans=[("cat", 2, 8)])  # its text before the image not computed
    started = h.add("s", [IMG] * 8 + [7], spans=[("dog", 0, 8)])
    h.push("s", "dog")
    ready = h.add("r", [IMG] * 8 + [8], spans=[("dog", 0, 8)])  # its image is here: nothing to wait for
    h.core.start_image_waits()
    assert queued.timings.embedding_wait_since is not None
    assert started.timings.embedding_wait_since is None and ready.timings.embedding_wait_since is None
    h.clock.now += 0.5
    h.push("q", "cat")  # the image ends the wait at once (the step budget counts it as a waiting prompt)
    assert queued.timings.embedding_wait_since is None and queued.timings.embedding_wait_s == 0.5
    h.run()
    assert queued.is_finished and started.is_finished and ready.is_finished


async def test_a_held_loop_still_sweeps_leases_and_reports_no_stall(monkeypatch):
    awaited, ready = [True], [False]
    bridge, order = _held_bridge(monkeypatch, awaited, ready, clock=time.monotonic, max_hold_period_s=30.0)
    sweeps: list[float] = []
    sweep = bridge.core.sweep
    monkeypatch.setattr(bridge.core, "sweep", lambda: (sweeps.append(time.monotonic()), sweep()))
    monkeypatch.setattr(bridge.core, "has_work", lambda: True)
    bridge.start()
    try:
        await asyncio.sleep(4 * bridge.core.sweep_interval_s)
        assert "step" not in order and len(sweeps) >= 2  # held, yet the loop came round and swept
        assert bridge.stalled_for() < 2 * bridge.core.sweep_interval_s
    finally:
        bridge.shutdown()

"""Metric scrapes and GetLoad reads against a stuck engine thread: they share one queued read.

Security review: each scrape queued its own stats command, which stayed
queued after the scrape's 2 s timeout, so a stuck engine collected one per
scrape and ran them all when it woke.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from core_support import FakeClock, make_core
from prometheus_client.parser import text_string_to_metric_families

from services.pd.bridge import EngineBridge
from services.pd.engine.errors import EngineError
from services.pd.metrics import PdMetrics

NUM_SCRAPES = 20


def _responsive(text: bytes) -> float:
    families = text_string_to_metric_families(text.decode())
    return next(s.value for f in families for s in f.samples if s.name == "epd_pd_engine_responsive")


class CountedStats:
    """Wraps ``EngineCore.stats`` to count the reads the engine thread made."""

    def __init__(self, read) -> None:
        self.read = read
        self.num_reads = 0
        self.fail = False

    def __call__(self):
        self.num_reads += 1
        if self.fail:
            raise RuntimeError("stats failed")
        return self.read()


@pytest.fixture
def bridge():
    core = make_core(clock=FakeClock())
    core.stats = CountedStats(core.stats)  # type: ignore[method-assign]
    bridge = EngineBridge(core)
    bridge.start()
    yield bridge
    bridge.shutdown()


async def _stuck(bridge: EngineBridge) -> tuple[threading.Event, asyncio.Future]:
    """Holds the engine thread in a command until the returned event is set."""
    release = threading.Event()
    held = asyncio.ensure_future(bridge.call(release.wait))
    while bridge._inbox.qsize():  # the thread has taken the command: it is stuck in it now
        await asyncio.sleep(0.001)
    return release, held


async def test_metrics_scrapes_of_a_stuck_engine_do_not_pile_up(bridge):
    patient = PdMetrics(bridge, snapshot_timeout_s=10.0)
    metrics = PdMetrics(bridge, snapshot_timeout_s=0.01)
    assert _responsive(await patient.render()) == 1
    reads_before = bridge.core.stats.num_reads
    release, held = await _stuck(bridge)
    for _ in range(NUM_SCRAPES):  # every scrape times out and serves the last values
        assert _responsive(await metrics.render()) == 0
        with pytest.raises(TimeoutError):  # GetLoad callers past their deadline, alike
            await asyncio.wait_for(bridge.shared_stats(), 0.001)
    assert bridge._inbox.qsize() == 1  # one shared read waits behind the stuck command
    release.set()
    await held
    await bridge._shared_stats  # the shared read runs once the engine is free
    assert _responsive(await patient.render()) == 1
    # The stuck period cost the engine one read, then the fresh scrape its own.
    assert bridge.core.stats.num_reads == reads_before + 2


async def test_a_shared_read_that_fails_fails_every_caller_waiting_on_it(bridge):
    release, held = await _stuck(bridge)
    bridge.core.stats.fail = True
    callers = [asyncio.ensure_future(bridge.shared_stats()) for _ in range(3)]
    late = asyncio.ensure_future(asyncio.wait_for(bridge.shared_stats(), 0.001))
    with pytest.raises(TimeoutError):  # this one gave up: the failure is not left unretrieved
        await late
    release.set()
    await held
    for caller in callers:
        with pytest.raises(RuntimeError):
            await caller
    assert bridge.core.stats.num_reads == 1
    bridge.core.stats.fail = False
    assert (await bridge.shared_stats()).num_running == 0  # the next caller starts a new read


async def test_a_scrape_of_a_stopped_engine_serves_the_last_values(bridge):
    metrics = PdMetrics(bridge, snapshot_timeout_s=1.0)
    assert _responsive(await metrics.render()) == 1
    bridge.shutdown()
    with pytest.raises(EngineError):
        await bridge.shared_stats()
    assert _responsive(await metrics.render()) == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_read_left_queued_by_a_dead_engine_thread_is_not_shared(bridge):
    release = threading.Event()

    def abort_then_die(request_id):
        release.wait()
        raise SystemExit  # not an Exception: it ends the engine thread, as a crash in a step would

    bridge.core.abort = abort_then_die  # type: ignore[method-assign]
    bridge.abort("r-1")
    while bridge._inbox.qsize():
        await asyncio.sleep(0.001)
    with pytest.raises(TimeoutError):  # queued behind the stuck abort
        await asyncio.wait_for(bridge.shared_stats(), 0.001)
    release.set()
    while bridge.is_alive:
        await asyncio.sleep(0.001)
    with pytest.raises(EngineError):  # at once, not after waiting on a read that will never run
        await asyncio.wait_for(bridge.shared_stats(), 1.0)

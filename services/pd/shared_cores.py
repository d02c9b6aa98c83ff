"""A PD that shares its CPU cores with an encoder: its OpenMP workers sleep while an image it awaits is encoded.

Idle workers that spin between parallel regions make a PD's steps faster
when it computes alone (a one-row decode step of the bench model: 23-28 ms
against 34-36 ms with sleeping workers, on the 2-core bench VM). When an
encoder computes on the same cores at the same time, a spinning worker takes
a core from it, and from its own team's thread that the encoder's threads
preempted: an image burst ran at 28-38 tok/s against 41 with sleeping
workers, mixed traffic at twice the inter-token latency
(``docs/benchmarks/compare.md``). So while any image embedding this PD has
room reserved for is still to arrive, its workers sleep; otherwise they spin.
The encoder's own workers never spin (``epd encoder`` sets
``OMP_WAIT_POLICY=PASSIVE`` unless the environment chose).
"""

from __future__ import annotations

from services.common import openmp
from services.pd.bridge import EngineBridge


def yield_cores_to_encoder(engine: EngineBridge) -> openmp.SleepingWorkers:
    """Registers the switch on the engine loop, asked before each step; returns it (its thread ends soon after
    the engine's)."""
    workers = openmp.SleepingWorkers(lambda: engine.is_alive)
    cache = engine.core.scheduler.embedding_cache
    engine.add_loop_hook(lambda: workers.set(cache.awaits_push()), before_step=True)
    return workers

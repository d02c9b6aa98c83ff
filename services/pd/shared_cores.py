"""A PD that shares its CPU cores with an encoder yields them while an image it awaits is encoded.

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

While such an image is awaited the PD also spaces its decode-only steps
``hold_s`` apart (until the image arrives), as a colocated PD's engine thread
is held by the vision forward it runs: the encoder gets the cores for the
image, and the streams decoding meanwhile still get a token every ``hold_s``
plus a step. A step that has a prompt to prefill is never held: a prompt that
arrives meanwhile starts at once, and a prompt whose image is awaited has the
text before its image computed first, so its wait for the image is counted as
such. It holds in the first ``max_hold_period_s`` of a stretch of awaiting
only, so that an encoder that never pushes (one that died with the image)
slows the PD for that long and not until the reservation's lease ends.
"""

from __future__ import annotations

import itertools
import time

from services.common import openmp
from services.pd.bridge import EngineBridge
from services.pd.engine.scheduler import Scheduler

HOLD_S = 0.35
"""About one image's vision forward on the bench checkpoint (2 CPU threads): 330-350 ms."""
MAX_HOLD_PERIOD_S = 2.0
"""An image burst's first encoder batches; past it, steps run while images are still awaited."""


def has_prefill_ready(scheduler: Scheduler) -> bool:
    """Whether a request has prompt tokens the next step could compute: not decoding, not blocked on an image."""
    return any(
        not request.is_decoding and request.timings.embedding_wait_since is None
        for request in itertools.chain(scheduler.running, scheduler.waiting)
    )


def yield_cores_to_encoder(
    engine: EngineBridge, hold_s: float = HOLD_S, max_hold_period_s: float = MAX_HOLD_PERIOD_S
) -> openmp.SleepingWorkers:
    """Registers both on the engine loop; returns the workers' switch (its thread ends soon after the engine's)."""
    workers = openmp.SleepingWorkers(lambda: engine.is_alive)
    scheduler = engine.core.scheduler
    cache = scheduler.embedding_cache
    awaiting = [False]  # asked once per loop iteration, before the step: the hook, then ``delay``
    awaiting_since: list[float | None] = [None]  # start of the current stretch of awaiting

    def before_step() -> None:
        awaiting[0] = cache.awaits_push()
        workers.set(awaiting[0])

    def delay() -> float:
        if hold_s <= 0 or not awaiting[0]:
            awaiting_since[0] = None
            return 0.0
        now = time.monotonic()
        since = awaiting_since[0] = awaiting_since[0] or now
        if now - since >= max_hold_period_s or has_prefill_ready(scheduler):
            return 0.0
        return max(0.0, min(hold_s - (now - engine.last_step_time), since + max_hold_period_s - now))

    engine.add_loop_hook(before_step, before_step=True)
    engine.set_step_delay(delay)
    return workers

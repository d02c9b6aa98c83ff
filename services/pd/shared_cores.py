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

Even with sleeping workers, a PD that computes beside the encoder slows
both: in an image burst on the 2-core bench VM, a PD that stepped whenever
it had work spent 19-20 CPU-seconds against 17-18.6 when it waited for the
encoder, and under mixed traffic an image's Encode took 582 ms (median)
against 393. So while such an image is awaited the PD also holds its steps
until the image arrives, as a colocated PD's engine thread is held by the
vision forward it runs: the encoder computes alone, and the prompts whose
images arrived meanwhile are prefilled together after it (image burst 1.05x
the throughput, ITL p99 0.76x; mixed traffic's ITL p99 0.76x, image TTFT
p50 0.91x: ``docs/benchmarks/compare.md``). A step with a text-only prompt
to prefill is never held: text does not wait for images. A prompt held with
its image still to come counts as waiting for it (``embedding_wait_s``),
though no step has reached its image yet. The PD holds in the first
``max_hold_period_s`` of a stretch of awaiting only, so that an encoder that
never pushes (one that died with the image) holds the PD for that long and
not until the reservation's lease ends, and a stream of images that never
lets up does not hold the PD for good.
"""

from __future__ import annotations

import itertools
import time

from services.common import openmp
from services.pd.bridge import EngineBridge
from services.pd.engine.scheduler import Scheduler

MAX_HOLD_PERIOD_S = 6.0
"""Longest the PD holds its steps in one stretch of awaiting images: an image burst's encoding
(16 images of the bench checkpoint on 2 CPU threads: ~4 s); past it, steps run while images are awaited."""


def has_text_prompt_ready(scheduler: Scheduler) -> bool:
    """Whether a prompt without images has tokens the next step could compute."""
    return any(
        not request.is_decoding and not request.mm_spans
        for request in itertools.chain(scheduler.running, scheduler.waiting)
    )


def yield_cores_to_encoder(
    engine: EngineBridge, max_hold_period_s: float = MAX_HOLD_PERIOD_S
) -> openmp.SleepingWorkers:
    """Registers both on the engine loop; returns the workers' switch (its thread ends soon after the engine's).

    ``max_hold_period_s`` 0 turns the hold off (the workers still sleep while an image is awaited)."""
    workers = openmp.SleepingWorkers(lambda: engine.is_alive)
    scheduler = engine.core.scheduler
    cache = scheduler.embedding_cache
    awaiting = [False]  # asked once per loop iteration, before the step: the hook, then ``delay``
    awaiting_since: list[float | None] = [None]  # start of the current stretch of awaiting

    def before_step() -> None:
        awaiting[0] = cache.awaits_push()
        workers.set(awaiting[0])

    def delay() -> float:
        if max_hold_period_s <= 0 or not awaiting[0]:
            awaiting_since[0] = None
            return 0.0
        now = time.monotonic()
        since = awaiting_since[0] = awaiting_since[0] or now
        if has_text_prompt_ready(scheduler):
            return 0.0
        engine.core.start_image_waits()  # a held prompt waits for its image: its wait counts as such
        # Until the period ends; a command that arrives (a push, a prompt) ends the wait early and the
        # engine thread asks again.
        return max(0.0, since + max_hold_period_s - now)

    engine.add_loop_hook(before_step, before_step=True)
    engine.set_step_delay(delay)
    return workers

"""Counters of the engine's step loop: steps, where their time goes, tokens, a step-time histogram.

Pure Python, no torch and no Prometheus: the engine thread writes a
``StepStats`` after every step; readers take a ``snapshot()`` on the engine
thread (``Engine.call``) so that what they see is consistent.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from services.pd.engine.outputs import ModelRunnerOutput, SchedulerOutput

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (``le``) of the step-time histogram; +Inf is implied."""


class Histogram:
    """Counts of observed values per upper bound (``le``) of ``bounds``, then +Inf, and their sum.

    The pure-Python side of a Prometheus histogram: the engine thread
    observes, a snapshot reads ``cumulative_counts`` and ``sum``.
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._hits = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; last = +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._hits[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative_counts(self) -> tuple[int, ...]:
        """Observations at or below each bound, then all of them (Prometheus ``_bucket``)."""
        return tuple(itertools.accumulate(self._hits))


@dataclass(frozen=True)
class StepSnapshot:
    """A copy of ``StepStats`` at one moment (all cumulative since start)."""

    num_steps: int
    seconds: dict[str, float]  # phase (schedule, execute, update) -> seconds
    num_prompt_tokens: int
    num_generation_tokens: int
    bucket_counts: tuple[int, ...]  # cumulative counts per bound of STEP_SECONDS_BUCKETS, then +Inf
    sum_seconds: float


class StepStats:
    """Engine-thread accounting of non-empty steps.

    - prompt tokens: a request's prompt length, counted once, in the step
      that samples its first token (prefix-cache hits included, so that
      hits / prompt tokens is a hit ratio);
    - generation tokens: every token the model sampled.
    """

    def __init__(self) -> None:
        self.num_steps = 0
        self.seconds = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._step_seconds = Histogram(STEP_SECONDS_BUCKETS)

    def record(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, seconds: float) -> None:
        """Accounts one executed step that took ``seconds`` end to end."""
        self.num_steps += 1
        self._step_seconds.observe(seconds)
        self.num_generation_tokens += len(runner_output.sampled)
        for chunk in scheduler_output.chunks:
            # No output yet and sampled now: this chunk ends the prompt, whose
            # length is where the chunk ends.
            if chunk.num_output_tokens == 0 and chunk.request_id in runner_output.sampled:
                self.num_prompt_tokens += chunk.start_pos + chunk.num_tokens

    def snapshot(self) -> StepSnapshot:
        return StepSnapshot(
            num_steps=self.num_steps,
            seconds=dict(self.seconds),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            bucket_counts=self._step_seconds.cumulative_counts(),
            sum_seconds=self._step_seconds.sum,
        )

"""How many prefill tokens the next step may take: decoding streams keep their
inter-token latency (ITL), waiting prompts make their time to first token (TTFT).

Pure Python. Every step, the engine core asks ``StepBudget.before_step``
for the prefill budget before it schedules, and shows ``after_step`` the
step it ran (which the ``StepTimeModel`` learns from). The rule:

- nothing decoding: prefill gets the whole step budget
  (``--max-num-batched-tokens``): a prompt arriving at an idle engine pays no
  time to first token for a latency nobody is waiting on;
- something decoding: each decoding stream waits for the whole next step,
  plus whatever the engine thread did since the last one (commands, and in
  colocated mode the vision forward of newly arrived images). The **ITL
  share** is the prefill chunk predicted to keep that wait within the ITL
  target: ``since_last_step + predicted(decode rows, prefill tokens) <=
  target``, using the online ``StepTimeModel``;
- waiting prompts may claim more (``slo.py``): the **head share**, the
  prompt first in line whole if the step stays within ``HEAD_STEP_MULTIPLE``
  ITL targets (else what fits); the **deadline share**, the least chunk per
  step that lets every prompt still able to meet its TTFT deadline meet it
  (an approaching deadline wins over the ITL target; a lost one does not);
  and the **queue share** (a burst, many prompts waiting
  beside few streams, is prefilled in steps of whole prompts no longer than
  a head-share step, until what it had queued is computed; a few waiting
  prompts get one ITL share each). The step takes the largest of the four;
- the ITL target is ``--slo-itl-ms``, or with ``auto`` ``AUTO_TARGET_MULTIPLE``
  times the predicted decode-only step of the current batch; the TTFT target
  is ``--slo-ttft-ms``, or with ``auto`` ``AUTO_TTFT_MULTIPLE`` times the
  predicted lone prefill of the prompt, at least of a ``TYPICAL_PROMPT_TOKENS``
  prompt (both predictions are seeded by the warm-up's measured steps);
- prefill always gets at least ``min_prefill_tokens`` (the starvation guard):
  under a decode flood, or right after a long vision forward, a waiting
  prompt still advances, at the price of steps that can exceed the target by
  that chunk's time;
- ``--max-num-batched-tokens`` stays the cap of the whole step; decode rows
  take their one token each from it first;
- an ITL target of 0 turns the rule off (the whole cap every step), and so
  does a model not yet seeded (the warm-up seeds it before the server
  reports ready); a TTFT target of 0 turns the deadline share off.

Where both targets cannot hold, the choice is made for goodput (requests
that meet both): a step that saves a prompt's deadline costs each decoding
stream one longer gap, which its inter-token latency over the whole output
absorbs, while a missed deadline is lost for good; a prompt already lost
gains nothing from a longer step, so it does not get one.

The budget follows measured step times, so chunk boundaries differ between
runs; outputs do not (chunking never changes what a request computes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.pd.engine import slo
from services.pd.engine.outputs import SchedulerOutput
from services.pd.engine.request import Request
from services.pd.engine.step_stats import Histogram
from services.pd.engine.step_time_model import StepShape, StepTimeModel

AUTO_TARGET_MULTIPLE = 1.25
"""``--slo-itl-ms auto``: the target is this many times the predicted decode-only step at the current batch.

Small on purpose: a step that prefills doubles the inter-token latency of
every stream in it, and spreading a long prompt over many such steps hurt
p99 more than one long stall did (``epd bench serve --workload mixed``: 2x
was worse than a fixed 2048-token budget, 1.25x better)."""
AUTO_TTFT_MULTIPLE = 4.0
"""``--slo-ttft-ms auto``: a prompt's TTFT target is this many times its predicted lone prefill
(at least that of a ``TYPICAL_PROMPT_TOKENS`` prompt): room to queue behind a few others."""
TYPICAL_PROMPT_TOKENS = 256
"""The prompt length whose lone prefill sets the shortest auto TTFT target (the one metrics show)."""
HEAD_STEP_MULTIPLE = 8.0
"""The longest step the prompt at the head of the queue may make, in ITL targets (``slo.head_share``).

With ``auto``, ten decode-only steps: on the bench checkpoint on two CPU
cores 250-700 prompt tokens beside 1-30 decoding streams, so a typical
prompt, an image's included, starts in one step, while a prompt of thousands
of tokens is still split and no stream waits many seconds for one step."""
DEFAULT_MIN_PREFILL_TOKENS = 16
"""Prefill tokens every step may take whatever the target (one KV block with the default block size)."""
PREDICTION_RATIO_BUCKETS = (0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)
"""Upper bounds (``le``) of the measured / predicted step-time histogram (1 = exact); +Inf is implied.
A ratio rather than a difference: its meaning does not depend on how fast the device is."""


@dataclass(frozen=True)
class BudgetConfig:
    """What the budget controller is told at start-up."""

    max_num_batched_tokens: int  # the hard cap of one step
    target_itl_s: float | None = None  # None = auto; 0 = off (the whole cap every step)
    min_prefill_tokens: int = DEFAULT_MIN_PREFILL_TOKENS
    target_ttft_s: float | None = None  # None = auto; 0 = off (no deadline share)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.min_prefill_tokens <= 0:
            raise ValueError("max_num_batched_tokens and min_prefill_tokens must be positive")
        if self.target_itl_s is not None and not (0 <= self.target_itl_s < math.inf):
            raise ValueError("the inter-token latency target must be a finite number >= 0 (0 = off)")
        if self.target_ttft_s is not None and not (0 <= self.target_ttft_s < math.inf):
            raise ValueError("the time-to-first-token target must be a finite number >= 0 (0 = off)")

    @property
    def enabled(self) -> bool:
        return self.target_itl_s != 0


@dataclass(frozen=True)
class BudgetSnapshot:
    """The controller's state at one moment, for metrics and tests."""

    prefill_budget_tokens: int  # the last step's prefill budget
    itl_target_s: float  # the last target used (0 = off, or auto before anything decoded)
    num_limited_steps: int  # steps whose prefill filled a budget below the cap (held back)
    ratio_bucket_counts: tuple[int, ...]  # measured / predicted: cumulative per PREDICTION_RATIO_BUCKETS, then +Inf
    ratio_sum: float
    ttft_target_s: float = 0.0  # of a TYPICAL_PROMPT_TOKENS prompt (0 = off, or auto before seeding)
    num_ttft_missed: int = 0  # requests whose first token came after their TTFT target
    num_itl_missed: int = 0  # finished requests whose mean inter-token latency exceeded the ITL target


class StepBudget:
    """Sizes each step's prefill from a ``StepTimeModel`` so that decode keeps its target latency."""

    def __init__(self, config: BudgetConfig, model: StepTimeModel | None = None) -> None:
        self.config = config
        self.model = model or StepTimeModel()
        self._last_budget = config.max_num_batched_tokens
        self._target_s = config.target_itl_s or 0.0  # auto: set at the first decoding step
        self._num_limited_steps = 0
        self._ratios = Histogram(PREDICTION_RATIO_BUCKETS)  # measured / predicted step time
        self._last_step_end: float | None = None  # when the last executed step ended (the core's timer)
        self._num_ttft_missed = 0
        self._num_itl_missed = 0
        # Auto TTFT targets by prompt length, for the model's current fit: every step orders and
        # walks the whole queue by deadline, and the prediction behind a target costs two model calls.
        self._ttft_targets: dict[int, float] = {}
        self._ttft_targets_fit = -1  # the model's num_updates they were computed for
        # Prefill tokens a burst queued that are not computed yet (slo.py: "A burst is finished as a burst").
        self._burst_owed = 0

    @classmethod
    def off(cls, max_num_batched_tokens: int) -> StepBudget:
        """A controller that always answers the whole cap (``--slo-itl-ms 0``)."""
        return cls(BudgetConfig(max_num_batched_tokens, target_itl_s=0.0))

    # ------------------------------------------------------------- the core's calls
    def before_step(
        self, running: Iterable[Request], now: float, waiting: Iterable[Request] = (), clock_now: float | None = None
    ) -> int:
        """The prefill budget of a step starting at ``now`` (the core's timer), for the scheduler's
        ``running`` and ``waiting`` requests; ``clock_now`` is the same moment on the clock of the
        requests' timings (deadlines; None = no deadline share)."""
        # Decoding streams have waited since the last step ended (commands, a
        # colocated vision forward): that time counts against the target too.
        since_last_step_s = 0.0 if self._last_step_end is None else max(0.0, now - self._last_step_end)
        running = list(running)
        queue: list[slo.PendingPrompt] = []
        if clock_now is not None and self.config.enabled and self.model.is_seeded:
            candidates = [*running, *waiting]
            key = self.prefill_order(clock_now)
            if key is not None:
                candidates.sort(key=key)
            queue = slo.pending_prompts(candidates, clock_now, self.ttft_target_s)
        return self.prefill_budget(StepShape.decoding(running), since_last_step_s, queue)

    def prefill_order(self, clock_now: float) -> slo.PrefillKey | None:
        """The order in which the scheduler serves prefill at ``clock_now`` (``slo.prefill_key``);
        None (running prefills, then FCFS) while there are no TTFT targets."""
        if not (self.config.enabled and self.model.is_seeded and self.config.target_ttft_s != 0):
            return None
        return slo.prefill_key(clock_now, self.ttft_target_s)

    def after_step(self, scheduler_output: SchedulerOutput, started: float, ended: float) -> None:
        """Learns from a step that ran ``scheduler_output`` from ``started`` to ``ended``."""
        shape = StepShape.of_output(scheduler_output)
        held_back = self._last_budget < self.config.max_num_batched_tokens
        if held_back and shape.num_prefill_tokens >= self._last_budget:  # prefill wanted more than it got
            self._num_limited_steps += 1
        self.observe(shape, ended - started)
        self._last_step_end = ended
        self._burst_owed = max(0, self._burst_owed - shape.num_prefill_tokens)

    # ------------------------------------------------------------------ the rule
    def prefill_budget(
        self, decoding: StepShape, since_last_step_s: float = 0.0, queue: Sequence[slo.PendingPrompt] = ()
    ) -> int:
        """Prefill tokens the next step may take.

        ``decoding``: the next step's decode rows (``StepShape.decoding``);
        ``since_last_step_s``: engine-thread time since the last step ended,
        which the decoding streams have already waited; ``queue``: the
        prompts waiting for their first token, in the order they are served.
        """
        cap = self.config.max_num_batched_tokens
        budget = cap
        if self.config.enabled and decoding.num_decode_rows and self.model.is_seeded:
            base_s = self.model.predict(decoding)
            self._target_s = self.target_s(base_s)
            itl_share = self._fit(self._target_s - since_last_step_s - base_s)
            per_token_s = self.model.prefill_seconds_per_token
            head_fits = self._fit(HEAD_STEP_MULTIPLE * self._target_s - since_last_step_s - base_s)
            # Beside decoding streams a queue is prefilled in steps no longer than the head's: whole
            # prompts while they fit (at least the first), so the first of them start sooner.
            batch_fits = slo.whole_prompts(queue, head_fits)
            budget = max(
                itl_share,
                slo.head_share(queue, head_fits),
                min(batch_fits, slo.queue_share(queue, itl_share, cap, decoding.num_decode_rows)),
                slo.deadline_share(queue, base_s, per_token_s, cap, since_last_step_s),
                min(cap, batch_fits, self._owed_to_burst(queue, decoding.num_decode_rows)),
            )
        self._last_budget = budget
        return budget

    def _owed_to_burst(self, queue: Sequence[slo.PendingPrompt], num_decoding: int) -> int:
        """What is still owed to the last burst (a new burst owes its whole queue), never more than the queue holds."""
        queued = sum(prompt.num_tokens for prompt in queue)
        if slo.is_burst(len(queue), num_decoding):
            self._burst_owed = queued
        self._burst_owed = min(self._burst_owed, queued)
        return self._burst_owed

    def target_s(self, decode_step_s: float) -> float:
        """The latency target for a batch whose decode-only step takes ``decode_step_s``."""
        fixed = self.config.target_itl_s
        return AUTO_TARGET_MULTIPLE * decode_step_s if fixed is None else fixed

    def ttft_target_s(self, num_prompt_tokens: int) -> float:
        """The TTFT target of a prompt of this length (inf when off, or auto before the model is seeded)."""
        fixed = self.config.target_ttft_s
        if fixed is not None:
            return fixed or math.inf
        if not self.model.is_seeded:
            return math.inf
        if self._ttft_targets_fit != self.model.num_updates:
            self._ttft_targets.clear()
            self._ttft_targets_fit = self.model.num_updates
        num_tokens = max(num_prompt_tokens, TYPICAL_PROMPT_TOKENS)
        target = self._ttft_targets.get(num_tokens)
        if target is None:
            target = self._ttft_targets[num_tokens] = AUTO_TTFT_MULTIPLE * self.lone_prefill_s(num_tokens)
        return target

    def lone_prefill_s(self, num_tokens: int) -> float:
        """Predicted seconds to prefill ``num_tokens`` with nothing else running (whole-cap chunks)."""
        cap = self.config.max_num_batched_tokens
        full, rest = divmod(num_tokens, cap)
        return full * self.model.predict(StepShape(0, cap, 0)) + (
            self.model.predict(StepShape(0, rest, 0)) if rest else 0.0
        )

    # ------------------------------------------------------------- the outcomes
    def first_token(self, request: Request) -> None:
        """Counts ``request`` if its first token (``timings.first_token``) came after its TTFT target."""
        timings = request.timings
        if timings.first_token is None:
            return
        waited = timings.first_token - timings.arrival - timings.embedding_wait_s
        if waited > self.ttft_target_s(request.num_prompt_tokens):
            self._num_ttft_missed += 1

    def finished(self, request: Request) -> None:
        """Counts ``request`` if its mean inter-token latency exceeded the ITL target in force now."""
        timings, num_gaps = request.timings, len(request.output_token_ids) - 1
        if not self._target_s or num_gaps < 1 or timings.first_token is None or timings.finished is None:
            return
        if (timings.finished - timings.first_token) / num_gaps > self._target_s:
            self._num_itl_missed += 1

    def _fit(self, spare_s: float) -> int:
        """Most prefill tokens predicted to fit ``spare_s``, within [min_prefill_tokens, cap]."""
        cap = self.config.max_num_batched_tokens
        per_token_s = self.model.prefill_seconds_per_token
        fits = cap if per_token_s <= 0 else math.floor(max(0.0, spare_s) / per_token_s)
        return min(cap, max(self.config.min_prefill_tokens, fits))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Learns from one executed step; records how far off the prediction was once the model is seeded."""
        predicted = self.model.predict(shape)
        if self.model.is_seeded and predicted > 0:
            self._ratios.observe(seconds / predicted)
        self.model.observe(shape, seconds)

    def snapshot(self) -> BudgetSnapshot:
        return BudgetSnapshot(
            prefill_budget_tokens=self._last_budget,
            itl_target_s=self._target_s,
            num_limited_steps=self._num_limited_steps,
            ratio_bucket_counts=self._ratios.cumulative_counts(),
            ratio_sum=self._ratios.sum,
            ttft_target_s=self._finite(self.ttft_target_s(TYPICAL_PROMPT_TOKENS)),
            num_ttft_missed=self._num_ttft_missed,
            num_itl_missed=self._num_itl_missed,
        )

    @staticmethod
    def _finite(seconds: float) -> float:
        return seconds if seconds < math.inf else 0.0


class TokenBudget:
    """What is left of one step's tokens, as the scheduler spends them.

    Every chunk takes from ``num_tokens`` (the step budget); prefill chunks also
    from ``num_prefill`` (their share, ``StepBudget.prefill_budget``), less what
    is ``held_for_waiting`` (the scheduler keeps part of it for admissions).
    """

    def __init__(self, num_tokens: int, num_prefill: int | None) -> None:
        self.num_tokens = num_tokens
        self.num_prefill = num_tokens if num_prefill is None else max(0, num_prefill)
        self.held_for_waiting = 0

    def limit(self, decoding: bool) -> int:
        """Most tokens the next chunk may take."""
        if decoding:
            return self.num_tokens
        return min(self.num_tokens, max(0, self.num_prefill - self.held_for_waiting))

    def spend(self, num: int, decoding: bool) -> None:
        self.num_tokens -= num
        if not decoding:
            self.num_prefill -= num

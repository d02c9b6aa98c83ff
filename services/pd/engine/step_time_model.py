"""An online model of how long one engine step takes. Pure Python, no torch.

The model::

    seconds = t0 + t1 * decode_rows + t2 * prefill_tokens / 64 + t3 * context_tokens / 1024

- ``decode_rows``: requests that compute one token and sample the next;
- ``prefill_tokens``: every other token of the step (prompt chunks, recomputes);
- ``context_tokens``: keys the decode rows attend to (their lengths, summed).

Why this form: a step costs a fixed part (Python, kernel launches, the
sampler), a part that grows with the rows through the linear layers (decode
rows and prefill tokens alike), and the decode rows' reads of their KV. A
prefill chunk's own attention is folded into the per-token coefficient: the
fit is local to the chunk sizes and contexts the engine runs now, which is
what the budget asks about. The divisors only keep the coefficients of one
order of magnitude (the fit does not need them; its starting covariance does).

Why this fit: exponentially weighted recursive least squares. One 4x4
covariance and four coefficients, O(16) arithmetic per step, bounded memory
however long the run; a step ``n`` steps old weighs ``FORGETTING ** n``
(about 50 steps of memory), so the fit follows a machine that speeds up or
slows down and a batch mix that moves. Per-feature moving averages cannot
tell the fixed part from the per-row part when both move together (a decode
batch grows while its contexts lengthen); a joint least-squares fit can.
Three guards keep it sane on a noisy shared machine:

- residuals beyond ``OUTLIER_FACTOR`` x their running mean size are clipped
  (Huber-like), so one GC pause or one slow step moves the fit a bounded
  amount; a lasting change still comes through, as the running size grows
  geometrically while the residuals stay large;
- the covariance's trace is capped at its starting value: under forgetting,
  directions the recent steps do not excite (no prefill for a while) would
  otherwise grow without bound and make the next such step swing the fit;
- what the model answers is kept >= 0 (more work never makes a step
  faster): predictions, and the per-token prefill cost the budget divides
  by. The fit itself stays unconstrained: projecting its coefficients onto
  >= 0 would make them disagree with the covariance, which biases the
  warm-up's seed and can make the recursion diverge.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from services.pd.engine.outputs import SchedulerOutput
from services.pd.engine.request import Request

FORGETTING = 0.98
"""Weight decay per observed step (effective memory about 1 / (1 - 0.98) = 50 steps)."""
OUTLIER_FACTOR = 3.0
"""Residuals are clipped at this many times their running mean absolute size."""
RESIDUAL_SMOOTHING = 0.1
"""Weight of the newest residual in that running size."""
RELATIVE_RESIDUAL_FLOOR = 0.05
"""The running size never counts as below 5% of the prediction (a perfect fit must still learn a change)."""
MIN_RESIDUAL_S = 1e-4
"""... nor below 0.1 ms."""
PRIOR_VARIANCE = 100.0
"""Starting covariance: far wider than any coefficient (milliseconds), so the steps set the fit, not the prior."""
MIN_SEED_STEPS = 2
"""Decode-only steps and steps with prefill each, before the fit is trusted (the warm-up runs more)."""

_PREFILL_SCALE = 64.0
_CONTEXT_SCALE = 1024.0
_NUM_FEATURES = 4


class StepShape(NamedTuple):
    """The work of one step, as the model sees it."""

    num_decode_rows: int
    num_prefill_tokens: int
    num_context_tokens: int  # keys the decode rows attend to, summed over them

    @classmethod
    def of_output(cls, scheduler_output: SchedulerOutput) -> StepShape:
        """What a scheduled step computes. A decode row is a one-token chunk of a request with output."""
        num_rows = num_prefill = num_context = 0
        for chunk in scheduler_output.chunks:
            if chunk.num_tokens == 1 and chunk.num_output_tokens > 0:
                num_rows += 1
                num_context += chunk.start_pos + 1
            else:
                num_prefill += chunk.num_tokens
        return cls(num_rows, num_prefill, num_context)

    @classmethod
    def decoding(cls, requests: Iterable[Request]) -> StepShape:
        """The decode rows the next step will run for ``requests`` (the running ones), without prefill."""
        num_rows = num_context = 0
        for request in requests:
            if request.is_decoding:
                num_rows += 1
                num_context += request.num_tokens
        return cls(num_rows, 0, num_context)


class StepTimeModel:
    """Predicts a step's seconds from its ``StepShape``; learns from every step it is shown."""

    def __init__(self) -> None:
        self._coefficients = [0.0] * _NUM_FEATURES
        self._covariance = [
            [PRIOR_VARIANCE if i == j else 0.0 for j in range(_NUM_FEATURES)] for i in range(_NUM_FEATURES)
        ]
        self._max_trace = PRIOR_VARIANCE * _NUM_FEATURES
        self._residual_size: float | None = None  # running mean |residual|, seconds
        self.num_decode_steps = 0  # observed steps with decode rows and no prefill
        self.num_prefill_steps = 0  # observed steps with prefill tokens
        self.num_updates = 0  # observed steps of any kind: predictions change only when this does

    @property
    def is_seeded(self) -> bool:
        """Whether both kinds of step were seen often enough to trust ``prefill_seconds_per_token``."""
        return min(self.num_decode_steps, self.num_prefill_steps) >= MIN_SEED_STEPS

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds of a step of this shape (>= 0)."""
        return max(0.0, _dot(self._coefficients, _features(shape)))

    @property
    def prefill_seconds_per_token(self) -> float:
        """What one more prefill token adds to a step (>= 0)."""
        return max(0.0, self._coefficients[2]) / _PREFILL_SCALE

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Updates the fit with one measured step."""
        self.num_updates += 1
        if shape.num_prefill_tokens:
            self.num_prefill_steps += 1
        elif shape.num_decode_rows:
            self.num_decode_steps += 1
        x = _features(shape)
        p = self._covariance
        px = [_dot(row, x) for row in p]
        gain = [v / (FORGETTING + _dot(x, px)) for v in px]
        predicted = _dot(self._coefficients, x)
        error = self._clip(seconds - predicted, predicted)
        self._coefficients = [c + g * error for c, g in zip(self._coefficients, gain)]
        # P <- (P - g (Px)^T) / lambda, then the trace cap (see the module docstring).
        p = [[(p[i][j] - gain[i] * px[j]) / FORGETTING for j in range(_NUM_FEATURES)] for i in range(_NUM_FEATURES)]
        trace = sum(p[i][i] for i in range(_NUM_FEATURES))
        if trace > self._max_trace:
            p = [[v * self._max_trace / trace for v in row] for row in p]
        self._covariance = p

    def _clip(self, error: float, predicted: float) -> float:
        """The residual, clipped at OUTLIER_FACTOR x its running size; updates that size."""
        if self._residual_size is None:  # first step: nothing to compare with
            self._residual_size = abs(error)
            return error
        size = max(self._residual_size, RELATIVE_RESIDUAL_FLOOR * abs(predicted), MIN_RESIDUAL_S)
        bound = OUTLIER_FACTOR * size
        clipped = min(bound, max(-bound, error))
        self._residual_size += RESIDUAL_SMOOTHING * (abs(clipped) - self._residual_size)
        return clipped


def _features(shape: StepShape) -> list[float]:
    return [
        1.0,
        float(shape.num_decode_rows),
        shape.num_prefill_tokens / _PREFILL_SCALE,
        shape.num_context_tokens / _CONTEXT_SCALE,
    ]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(u * v for u, v in zip(a, b))

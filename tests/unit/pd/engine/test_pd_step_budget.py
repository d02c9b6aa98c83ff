"""The step-time model and the step budget controller, fed hand-made step timings (pure Python, no model)."""

from __future__ import annotations

import random

import pytest

from services.pd.engine.outputs import ScheduledChunk, SchedulerOutput
from services.pd.engine.request import Request, RequestStatus, SamplingParams
from services.pd.engine.step_budget import (
    AUTO_TARGET_MULTIPLE,
    PREDICTION_RATIO_BUCKETS,
    BudgetConfig,
    StepBudget,
    TokenBudget,
)
from services.pd.engine.step_time_model import StepShape, StepTimeModel

CAP = 512


def law(shape: StepShape, scale: float = 1.0) -> float:
    """The hand-made truth: 10 ms fixed, 2 ms per decode row, 0.5 ms per prefill token, 10 us per context token."""
    return scale * (
        0.010 + 0.002 * shape.num_decode_rows + 0.0005 * shape.num_prefill_tokens + 0.00001 * shape.num_context_tokens
    )


def random_shape(rng: random.Random) -> StepShape:
    rows = rng.randint(0, 16)
    prefill = rng.choice([0, 0, rng.randint(1, 256)]) if rows else rng.randint(1, 256)
    return StepShape(rows, prefill, rows * rng.randint(8, 512))


def trained(steps: int = 200, seed: int = 0, noise: float = 0.0) -> StepTimeModel:
    rng = random.Random(seed)
    model = StepTimeModel()
    for _ in range(steps):
        shape = random_shape(rng)
        model.observe(shape, law(shape) * (1 + rng.uniform(-noise, noise)))
    return model


def relative_error(model: StepTimeModel, shapes: list[StepShape], scale: float = 1.0) -> float:
    return max(abs(model.predict(s) - law(s, scale)) / law(s, scale) for s in shapes)


PROBES = [
    StepShape(1, 0, 40),
    StepShape(8, 0, 2000),
    StepShape(4, 48, 800),
    StepShape(0, 200, 0),
    StepShape(16, 16, 6000),
]


# -------------------------------------------------------------------- the model
def test_the_model_converges_to_the_step_time_law():
    model = trained()
    assert relative_error(model, PROBES) < 0.01
    assert model.prefill_seconds_per_token == pytest.approx(0.0005, rel=0.01)


@pytest.mark.parametrize("seed", range(3))
def test_the_model_converges_with_noisy_timings(seed):
    # +-10% on every step; the smallest probe (12 ms) is the hardest among steps of up to 200 ms.
    assert relative_error(trained(steps=400, noise=0.1, seed=seed), PROBES) < 0.15


def test_one_outlier_step_moves_the_model_a_bounded_amount():
    model = trained()
    before = [model.predict(s) for s in PROBES]
    model.observe(StepShape(4, 0, 400), 2.0)  # a 2 s GC pause in a ~20 ms step
    after = [model.predict(s) for s in PROBES]
    assert max(abs(a - b) / b for a, b in zip(after, before)) < 0.15


def test_the_model_follows_a_lasting_slowdown():
    model = trained()
    rng = random.Random(1)
    for _ in range(250):  # a few times the model's memory (about 50 steps)
        shape = random_shape(rng)
        model.observe(shape, law(shape, scale=2.0))
    assert relative_error(model, PROBES, scale=2.0) < 0.03


def test_a_long_decode_only_stretch_does_not_wind_the_model_up():
    model = trained()
    rng = random.Random(2)
    for _ in range(2000):  # no prefill at all: that direction gets no information
        shape = StepShape(rng.randint(1, 16), 0, rng.randint(100, 4000))
        model.observe(shape, law(shape))
    assert model.prefill_seconds_per_token == pytest.approx(0.0005, rel=0.05)
    # One noisy prefill step now moves the prefill cost by at most the clipped residual.
    model.observe(StepShape(2, 64, 200), law(StepShape(2, 64, 200)) * 1.3)
    assert relative_error(model, PROBES) < 0.25


def test_costs_never_go_negative():
    model = StepTimeModel()
    rng = random.Random(4)
    for _ in range(100):  # prefill is free here, steps are noisy: a plain fit would go below zero
        shape = random_shape(rng)
        model.observe(shape, 0.010 * (1 + rng.uniform(-0.3, 0.3)))
    assert model.prefill_seconds_per_token >= 0
    assert all(model.predict(s) >= 0 for s in PROBES)


def test_the_model_is_seeded_once_it_saw_decode_only_and_prefill_steps():
    model = StepTimeModel()
    for shape in (StepShape(0, 32, 0), StepShape(1, 0, 33), StepShape(0, 64, 0)):
        model.observe(shape, law(shape))
        assert not model.is_seeded
    model.observe(StepShape(1, 0, 34), law(StepShape(1, 0, 34)))
    assert model.is_seeded


# --------------------------------------------------------------- the controller
def seeded_budget(target_s: float | None = None, min_prefill: int = 16, cap: int = CAP) -> StepBudget:
    return StepBudget(BudgetConfig(cap, target_s, min_prefill), trained())


def test_nothing_decoding_gives_prefill_the_whole_cap():
    budget = seeded_budget(target_s=0.001)
    assert budget.prefill_budget(StepShape(0, 0, 0), since_last_step_s=5.0) == CAP


def test_target_zero_gives_the_whole_cap_every_step():
    budget = seeded_budget(target_s=0.0)
    for rows in (1, 8, 64):
        assert budget.prefill_budget(StepShape(rows, 0, rows * 100), since_last_step_s=1.0) == CAP
    assert budget.snapshot().itl_target_s == 0 and budget.snapshot().num_limited_steps == 0


def test_an_unseeded_model_gives_the_whole_cap():
    budget = StepBudget(BudgetConfig(CAP, 0.02))
    assert budget.prefill_budget(StepShape(4, 0, 400)) == CAP


def test_the_budget_fills_the_fixed_target():
    target = 0.040
    budget = seeded_budget(target_s=target)
    decoding = StepShape(4, 0, 800)
    tokens = budget.prefill_budget(decoding)
    # 10 + 8 + 8 ms of decode step leave 14 ms: 28 tokens at 0.5 ms.
    assert law(decoding._replace(num_prefill_tokens=tokens)) <= target * 1.01
    assert law(decoding._replace(num_prefill_tokens=tokens + 2)) > target
    assert budget.snapshot().prefill_budget_tokens == tokens


def test_auto_target_is_a_multiple_of_the_decode_only_step():
    budget = seeded_budget(target_s=None)
    decoding = StepShape(8, 0, 2000)
    tokens = budget.prefill_budget(decoding)
    base = law(decoding)
    assert budget.snapshot().itl_target_s == pytest.approx(AUTO_TARGET_MULTIPLE * base, rel=0.01)
    assert tokens == pytest.approx((AUTO_TARGET_MULTIPLE - 1) * base / 0.0005, abs=2)


def test_prefill_gets_its_minimum_under_a_decode_flood():
    budget = seeded_budget(target_s=0.030, min_prefill=16)
    flood = StepShape(64, 0, 64 * 1000)  # the decode-only step alone takes 0.8 s
    assert budget.prefill_budget(flood) == 16


def test_time_the_decoders_already_waited_counts_against_the_target():
    budget = seeded_budget(target_s=0.040)
    decoding = StepShape(4, 0, 800)
    full = budget.prefill_budget(decoding)
    assert budget.prefill_budget(decoding, since_last_step_s=0.005) == pytest.approx(full - 10, abs=2)
    assert budget.prefill_budget(decoding, since_last_step_s=0.5) == 16  # e.g. a colocated vision forward


@pytest.mark.parametrize("seed", range(5))
def test_the_budget_never_exceeds_the_cap(seed):
    rng = random.Random(seed)
    cap = rng.randint(1, 64)
    budget = StepBudget(BudgetConfig(cap, rng.choice([None, 0.0, 0.001, 10.0]), rng.randint(1, 128)), trained())
    for _ in range(200):
        shape = random_shape(rng)
        tokens = budget.prefill_budget(shape._replace(num_prefill_tokens=0), rng.uniform(0, 0.1))
        assert 1 <= tokens <= cap
        budget.observe(shape, law(shape) * rng.uniform(0.5, 3.0))


def test_closed_loop_budget_converges_to_what_the_target_allows():
    """From a cold model: the warm-up's steps, then steps whose prefill the controller picks and the law times."""
    budget = StepBudget(BudgetConfig(CAP, 0.050))
    for shape in (
        StepShape(0, 16, 0),
        StepShape(1, 0, 17),
        StepShape(0, 64, 0),
        StepShape(1, 0, 65),
        StepShape(0, 192, 0),
        StepShape(1, 0, 193),
        StepShape(4, 0, 40),
    ):
        budget.observe(shape, law(shape))
    decoding = StepShape(6, 0, 1200)
    ideal = (0.050 - law(decoding)) / 0.0005  # 52 tokens
    picked = []
    for _ in range(40):
        tokens = budget.prefill_budget(decoding)
        picked.append(tokens)
        step = decoding._replace(num_prefill_tokens=tokens)
        budget.observe(step, law(step))
    assert abs(picked[-1] - ideal) <= 2
    assert all(abs(p - ideal) <= 2 for p in picked[-10:])


def test_before_and_after_step_measure_the_gap_between_steps():
    budget = seeded_budget(target_s=0.040)
    running: list = []  # nothing decoding: the whole cap
    assert budget.before_step(running, now=10.0) == CAP
    step = SchedulerOutput(chunks=[ScheduledChunk("a", [1] * 8, 0, [0])])
    budget.after_step(step, started=10.0, ended=10.02)
    assert budget.snapshot().ratio_bucket_counts[-1] == 1  # one step measured against its prediction
    decoding = Request(
        "b", [1] * 4, SamplingParams(), output_token_ids=[5], num_computed_tokens=4, status=RequestStatus.RUNNING
    )
    # The decoding stream waited from 10.02 to 10.05: 30 of its 40 ms are gone before the step starts.
    squeezed = budget.before_step([decoding], now=10.05)
    assert squeezed == budget.prefill_budget(StepShape(1, 0, 5), since_last_step_s=0.03) < CAP
    budget.after_step(
        SchedulerOutput(
            chunks=[ScheduledChunk("b", [5], 4, [0], num_output_tokens=1), ScheduledChunk("c", [1] * squeezed, 0, [1])]
        ),
        10.05,
        10.06,
    )
    assert budget.snapshot().num_limited_steps == 1  # its prefill filled a budget below the cap


def test_prediction_ratios_land_in_their_buckets():
    budget = seeded_budget()
    shape = StepShape(2, 0, 100)
    budget.observe(shape, budget.model.predict(shape))  # exact: ratio 1.0, on its bound
    budget.observe(shape, budget.model.predict(shape) * 10)  # beyond the last bound
    snapshot = budget.snapshot()
    assert snapshot.ratio_bucket_counts[PREDICTION_RATIO_BUCKETS.index(1.0) - 1] == 0
    assert snapshot.ratio_bucket_counts[PREDICTION_RATIO_BUCKETS.index(1.0)] == 1
    assert snapshot.ratio_bucket_counts[-2] == 1 and snapshot.ratio_bucket_counts[-1] == 2
    assert snapshot.ratio_sum == pytest.approx(11.0, rel=0.01)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_num_batched_tokens": 0}, {"min_prefill_tokens": 0}, {"target_itl_s": -1.0}, {"target_itl_s": float("inf")}],
)
def test_impossible_budget_configs_are_refused(kwargs):
    with pytest.raises(ValueError):
        BudgetConfig(**{"max_num_batched_tokens": 64, **kwargs})


def test_token_budget_charges_prefill_to_both_shares():
    budget = TokenBudget(10, 3)
    assert budget.limit(decoding=False) == 3 and budget.limit(decoding=True) == 10
    budget.spend(3, decoding=False)
    budget.spend(1, decoding=True)
    assert budget.limit(decoding=False) == 0 and budget.limit(decoding=True) == 6
    assert TokenBudget(10, None).limit(decoding=False) == 10

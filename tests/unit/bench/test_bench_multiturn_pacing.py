"""``epd bench multiturn``'s pacing: users start at seeded, uneven gaps and think for seeded, uneven times,
so their turns interleave as real chats' do; the same seed and run give every policy the same schedule."""

from __future__ import annotations

import statistics

import pytest

from services.bench.multiturn.conversations import PACINGS, ChatPlan, pacing

PLAN = ChatPlan(num_users=8, num_turns=4, seed=3)


@pytest.mark.parametrize("kind", PACINGS)
def test_the_same_seed_and_run_give_the_same_schedule(kind):
    assert pacing(PLAN, 1, 1.0, 2.0, kind) == pacing(PLAN, 1, 1.0, 2.0, kind)


def test_runs_and_seeds_give_different_schedules():
    first = pacing(PLAN, 0, 1.0, 2.0)
    assert pacing(PLAN, 1, 1.0, 2.0) != first
    assert pacing(ChatPlan(num_users=8, num_turns=4, seed=4), 0, 1.0, 2.0) != first


@pytest.mark.parametrize("kind", ["exponential", "uniform"])
def test_users_start_in_order_at_uneven_gaps_and_think_for_uneven_times(kind):
    paces = pacing(PLAN, 0, 1.0, 2.0, kind)
    assert len(paces) == PLAN.num_users
    assert all(len(p.think_s) == PLAN.num_turns - 1 for p in paces)
    starts = [p.start_s for p in paces]
    assert starts[0] == 0.0 and starts == sorted(starts)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert len({round(g, 6) for g in gaps}) == len(gaps)
    thinks = [t for p in paces for t in p.think_s]
    assert len({round(t, 6) for t in thinks}) == len(thinks)
    assert all(t >= 0 for t in thinks)


def test_exponential_draws_average_the_means_and_are_capped():
    plan = ChatPlan(num_users=400, num_turns=6, seed=0)
    paces = pacing(plan, 0, 1.0, 2.0)
    thinks = [t for p in paces for t in p.think_s]
    assert statistics.mean(thinks) == pytest.approx(2.0, rel=0.15)
    assert max(thinks) <= 10.0
    assert paces[-1].start_s / (plan.num_users - 1) == pytest.approx(1.0, rel=0.15)


def test_uniform_draws_stay_within_half_the_mean():
    thinks = [t for p in pacing(ChatPlan(num_users=50, seed=1), 0, 1.0, 2.0, "uniform") for t in p.think_s]
    assert all(1.0 <= t <= 3.0 for t in thinks)


def test_fixed_pacing_is_the_lock_step():
    paces = pacing(PLAN, 0, 0.25, 0.5, "fixed")
    assert [p.start_s for p in paces] == pytest.approx([0.25 * user for user in range(PLAN.num_users)])
    assert {t for p in paces for t in p.think_s} == {0.5}


def test_zero_means_draw_no_pause():
    assert all(p.start_s == 0.0 and set(p.think_s) == {0.0} for p in pacing(PLAN, 0, 0.0, 0.0))


def test_an_unknown_pacing_is_refused():
    with pytest.raises(ValueError, match="unknown pacing"):
        pacing(PLAN, 0, 1.0, 2.0, "normal")

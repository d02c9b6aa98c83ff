"""The SLO-aware step budget with hand-made timings: deadlines, queues and the ITL target (pure Python, no model)."""

from __future__ import annotations

import math
import random

import pytest
from test_pd_step_budget import law, trained

from services.pd.engine import slo
from services.pd.engine.outputs import ScheduledChunk, SchedulerOutput
from services.pd.engine.request import Request, RequestStatus, SamplingParams
from services.pd.engine.slo import PendingPrompt, deadline_share, pending_prompts, queue_share
from services.pd.engine.step_budget import (
    AUTO_TTFT_MULTIPLE,
    TYPICAL_PROMPT_TOKENS,
    BudgetConfig,
    StepBudget,
)
from services.pd.engine.step_time_model import StepShape

CAP = 2048
DECODING = StepShape(8, 0, 2000)  # law: 10 + 16 + 20 ms = 46 ms decode-only
PER_TOKEN_S = 0.0005


def budget(itl_s: float | None = None, ttft_s: float | None = None, min_prefill: int = 16) -> StepBudget:
    return StepBudget(BudgetConfig(CAP, itl_s, min_prefill, ttft_s), trained())


def itl_share(b: StepBudget) -> int:
    return b.prefill_budget(DECODING)


# --------------------------------------------------------------- the rules
def test_a_burst_is_prefilled_in_whole_prompts_not_one_itl_share_at_a_time():
    b = budget()
    alone = itl_share(b)  # 8 streams decoding: the head's step may take (8 x 57.5 - 46) ms, 828 tokens
    burst = [PendingPrompt(100, -1.0) for _ in range(6)]  # 6 prompts waiting: >= half as many as streams
    assert alone < 30 and b.prefill_budget(DECODING, queue=burst) == 600  # all of them, in one step
    big = [PendingPrompt(300, -1.0) for _ in range(24)]
    assert b.prefill_budget(DECODING, queue=big) == 600  # the whole prompts a head's step holds
    assert budget().prefill_budget(StepShape(0, 0, 0), queue=big) == CAP  # nothing decoding: up to the cap
    assert b.prefill_budget(DECODING, queue=[PendingPrompt(1500, -1.0)] * 4) == 1500  # at least the first, whole


def test_a_burst_larger_than_the_cap_is_finished_in_whole_prompt_steps():
    """Its tail is few prompts beside the many streams it started, yet is still owed what it queued."""
    b = budget()
    burst = [PendingPrompt(150, -1.0)] * 32  # 4800 tokens arriving at an idle engine
    assert b.prefill_budget(StepShape(0, 0, 0), queue=burst) == CAP
    b.after_step(_prefill_step(CAP), started=1.0, ended=1.5)
    # 18 prompts left beside the 13 that started: whole prompts, as many as a head's step holds (8 ITL targets).
    left = [PendingPrompt(150, -1.0)] * 18
    step = b.prefill_budget(StepShape(13, 0, 1600), queue=left)
    assert step % 150 == 0 and 150 < step < 18 * 150
    b.after_step(_prefill_step(step), started=1.5, ended=1.9)
    # The rest beside 29 streams: no longer a burst by the count, still owed, and a head's step holds them all.
    tail = [PendingPrompt(150, -1.0)] * (18 - step // 150)
    busy = StepShape(29, 0, 5000)
    assert b.prefill_budget(busy, queue=tail) == 150 * len(tail)
    b.after_step(_prefill_step(150 * len(tail)), started=1.9, ended=2.9)
    # Paid off: of the next prompts behind the busy batch, the first in line goes whole; the rest wait their turn.
    later = [PendingPrompt(500, 1e6)] * 3
    assert b.prefill_budget(busy, queue=later) == 500


def test_what_a_burst_is_owed_never_exceeds_what_is_queued():
    b, busy = budget(), StepShape(29, 0, 5000)
    alone = budget().prefill_budget(busy)
    assert b.prefill_budget(StepShape(0, 0, 0), queue=[PendingPrompt(1500, -1.0)] * 4) == CAP
    # Its prompts were aborted: one short prompt is left, and it gets only what it needs (not the cap).
    assert alone < 100 and b.prefill_budget(busy, queue=[PendingPrompt(100, 1e6)]) == 100
    b.after_step(_prefill_step(100), started=1.0, ended=1.2)
    # Prompts arriving later are not owed the rest of the old burst (1600 here): the first in line goes whole.
    assert b.prefill_budget(busy, queue=[PendingPrompt(800, 1e6)] * 2) == 800


def _prefill_step(num_tokens: int) -> SchedulerOutput:
    return SchedulerOutput(chunks=[ScheduledChunk("p", [1] * num_tokens, 0, [0])])


def head_fits(b: StepBudget, shape: StepShape) -> int:
    """The head share of a prompt too long for one step (no deadline, alone in the queue)."""
    return b.prefill_budget(shape, queue=[PendingPrompt(10**6, 1e6)])


def test_a_few_prompts_behind_many_streams_start_one_per_step():
    b = budget()
    busy = StepShape(16, 0, 4000)  # 82 ms decode-only: 102.5 ms target; 8 targets = 820 ms
    alone = b.prefill_budget(busy)
    assert b.prefill_budget(busy, queue=[PendingPrompt(500, 1e6)] * 3) == 500  # the first in line, whole
    # Prompts too long for one step: the first gets what fits in 8 targets, more than an ITL share each.
    assert 3 * alone < b.prefill_budget(busy, queue=[PendingPrompt(3000, 1e6)] * 3) == head_fits(b, busy) < 3000


def test_a_burst_at_an_idle_engine_gets_the_whole_cap():
    b = budget()
    assert b.prefill_budget(StepShape(0, 0, 0), queue=[PendingPrompt(100, 5.0)] * 32) == CAP


def test_one_prompt_behind_a_busy_batch_starts_in_one_step_if_it_fits():
    b = budget()
    target = b.target_s(law(DECODING))  # 57.5 ms
    assert b.prefill_budget(DECODING, queue=[PendingPrompt(800, 100.0)]) == 800
    # Too long for one step of 8 targets: as much of it as fits, and the step stays within them.
    tokens = b.prefill_budget(DECODING, queue=[PendingPrompt(5000, 100.0)])
    assert itl_share(b) < tokens < 5000
    assert law(StepShape(8, tokens, 2000)) <= 8 * target + 1e-9 < law(StepShape(8, tokens + 2, 2000))
    # Time the engine thread already spent since the last step comes off it.
    assert b.prefill_budget(DECODING, 0.1, queue=[PendingPrompt(5000, 100.0)]) == tokens - 200


def test_an_approaching_deadline_wins_over_the_itl_target():
    b = budget(itl_s=0.050)  # 4 ms of prefill room: 8 tokens, i.e. the 16-token minimum
    assert itl_share(b) == 16
    head = head_fits(b, DECODING)  # (8 * 50 - 46) ms of prefill: 708 tokens
    assert head == 708
    # 3000 tokens due in 2.5 s: at most (2.5 - 1.5) / 0.046 = 21 steps, so 143 tokens a step: the head share is more.
    assert b.prefill_budget(DECODING, queue=[PendingPrompt(3000, 2.5)]) == head
    # Due in 1.6 s: two steps of 1500, more than the head share.
    tokens = b.prefill_budget(DECODING, queue=[PendingPrompt(3000, 1.6)])
    assert tokens == 1500 and 2 * law(DECODING) + 3000 * PER_TOKEN_S <= 1.6  # it makes the deadline
    # Behind a prompt with no deadline left, a short one due soon still gets what it needs.
    queue = [PendingPrompt(100, 1e6), PendingPrompt(1900, 1.1)]
    assert b.prefill_budget(DECODING, queue=queue) == 1000
    distant = b.prefill_budget(DECODING, queue=[PendingPrompt(3000, 60.0)])
    assert distant == head  # a distant deadline asks for nothing


def test_a_lost_deadline_asks_for_no_more_than_the_head_share():
    b = budget(itl_s=0.050)
    # 4000 tokens cannot be computed in 0.5 s even in whole-cap steps: no deadline share, not the cap.
    assert b.prefill_budget(DECODING, queue=[PendingPrompt(4000, 0.5)]) == head_fits(b, DECODING) < CAP
    # ... but a prompt behind it that can still make its own deadline gets what it needs.
    queue = [PendingPrompt(300, -2.0), PendingPrompt(50, 0.5)]
    tokens = b.prefill_budget(DECODING, queue=queue)
    assert tokens >= 350 / math.floor((0.5 - 350 * PER_TOKEN_S) / law(DECODING))


def test_a_decode_flood_still_lets_prompts_advance():
    b = budget(itl_s=0.030, min_prefill=16)
    flood = StepShape(64, 0, 64 * 1000)  # the decode-only step alone takes 0.8 s
    assert b.prefill_budget(flood, queue=[PendingPrompt(500, 1e6)]) == 16
    assert b.prefill_budget(flood, queue=[PendingPrompt(500, -1.0)]) == 16


def test_the_ttft_target_off_leaves_the_itl_head_and_queue_shares():
    b = budget(itl_s=0.050, ttft_s=0.0)
    assert b.ttft_target_s(100) == math.inf
    assert b.prefill_budget(DECODING, queue=slo_queue(b, [(600, 0.0)], now=0.5)) == 600
    assert b.prefill_budget(DECODING, queue=slo_queue(b, [(3000, 0.0)], now=0.5)) == head_fits(b, DECODING)


def slo_queue(b: StepBudget, prompts: list[tuple[int, float]], now: float) -> list[PendingPrompt]:
    requests = [request(f"r{i}", n, arrival) for i, (n, arrival) in enumerate(prompts)]
    return pending_prompts(requests, now, b.ttft_target_s)


@pytest.mark.parametrize("seed", range(8))
def test_the_cap_is_never_exceeded(seed):
    rng = random.Random(seed)
    cap = rng.randint(1, 4096)
    b = StepBudget(BudgetConfig(cap, rng.choice([None, 0.0, 0.001, 0.05]), rng.randint(1, 64), None), trained())
    for _ in range(200):
        rows = rng.randint(0, 64)
        queue = [PendingPrompt(rng.randint(1, 3000), rng.uniform(-2, 5)) for _ in range(rng.randint(0, 40))]
        tokens = b.prefill_budget(StepShape(rows, 0, rows * 300), rng.uniform(0, 0.1), queue)
        assert 1 <= tokens <= cap


# ---------------------------------------------------------- the pure functions
def test_deadline_share_is_the_least_chunk_that_makes_every_feasible_deadline():
    base, c = 0.010, 0.001
    # 100 tokens due in 0.5 s: 100 ms of work leaves room for 40 steps: 3 tokens a step.
    assert deadline_share([PendingPrompt(100, 0.5)], base, c, CAP) == 3
    # the second prompt counts the first's tokens too: 300 tokens, 0.2 s of room, 20 steps: 15 a step
    assert deadline_share([PendingPrompt(100, 0.5), PendingPrompt(200, 0.5)], base, c, CAP) == 15
    # engine-thread time already spent shrinks the room
    assert deadline_share([PendingPrompt(100, 0.5)], base, c, CAP, since_last_step_s=0.3) == 10
    assert deadline_share([PendingPrompt(100, 0.05)], base, c, CAP) == 0  # lost: nothing asked
    assert deadline_share([PendingPrompt(100, 0.5)], base, 0.0, CAP) == 0  # nothing predictable
    assert deadline_share([PendingPrompt(5000, 100.0)], base, c, 64) <= 64


def test_queue_share_batches_a_burst_and_shares_a_short_queue():
    assert queue_share([], 20, CAP, 4) == 0
    assert queue_share([PendingPrompt(500, 1.0)], 20, CAP, 0) == 0  # one prompt: the ITL share alone
    assert queue_share([PendingPrompt(500, 1.0)] * 3, 20, CAP, 16) == 60  # few beside many: a share each
    assert queue_share([PendingPrompt(10, 1.0)] * 3, 20, CAP, 16) == 30  # no more than they need
    assert queue_share([PendingPrompt(100, 1.0)] * 8, 20, CAP, 16) == 800  # a burst: the whole queue
    assert queue_share([PendingPrompt(500, 1.0)] * 300, 20, CAP, 16) == CAP


def request(request_id: str, num_tokens: int, arrival: float) -> Request:
    r = Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=4))
    r.timings.arrival = arrival
    return r


def test_pending_prompts_keeps_order_and_skips_what_has_no_deadline():
    b = budget(ttft_s=1.0)
    partly = request("partly", 100, arrival=0.0)
    partly.num_computed_tokens = 40
    decoding = request("decoding", 50, arrival=0.0)
    decoding.timings.first_token = 0.2
    blocked = request("blocked", 80, arrival=0.0)
    blocked.timings.embedding_wait_since = 0.1
    waited = request("waited", 30, arrival=0.0)
    waited.timings.embedding_wait_s = 0.5  # time blocked on its image does not count against it
    queue = pending_prompts([partly, decoding, blocked, waited], 0.25, b.ttft_target_s)
    assert queue == [PendingPrompt(60, pytest.approx(0.75)), PendingPrompt(30, pytest.approx(1.25))]


def test_pending_prompts_looks_at_a_bounded_head_of_the_queue():
    b = budget(ttft_s=1.0)
    many = [request(f"r{i}", 10, 0.0) for i in range(slo.MAX_PENDING_PROMPTS + 50)]
    assert len(pending_prompts(many, 0.0, b.ttft_target_s)) == slo.MAX_PENDING_PROMPTS


def test_auto_ttft_target_is_a_multiple_of_the_lone_prefill_at_least_of_a_typical_prompt():
    b = budget()
    typical = AUTO_TTFT_MULTIPLE * law(StepShape(0, TYPICAL_PROMPT_TOKENS, 0))
    assert b.ttft_target_s(10) == pytest.approx(typical, rel=0.02)
    assert b.ttft_target_s(TYPICAL_PROMPT_TOKENS) == pytest.approx(typical, rel=0.02)
    assert b.ttft_target_s(1000) == pytest.approx(AUTO_TTFT_MULTIPLE * law(StepShape(0, 1000, 0)), rel=0.02)
    assert b.ttft_target_s(5000) > b.ttft_target_s(1000)  # longer than the cap: several lone steps
    assert b.snapshot().ttft_target_s == pytest.approx(typical, rel=0.02)
    assert StepBudget(BudgetConfig(CAP)).ttft_target_s(100) == math.inf  # unseeded: no deadlines yet
    assert budget(ttft_s=0.3).ttft_target_s(5000) == 0.3  # a fixed target is the same for every prompt


def test_missed_targets_are_counted_per_request():
    b = budget(itl_s=0.050, ttft_s=1.0)
    b.prefill_budget(DECODING)  # sets the ITL target in force
    fast, slow = request("fast", 10, 0.0), request("slow", 10, 0.0)
    fast.timings.first_token, slow.timings.first_token = 0.5, 1.5
    b.first_token(fast)
    b.first_token(slow)
    fast.output_token_ids, slow.output_token_ids = [1] * 11, [1] * 11
    fast.timings.finished = 0.5 + 10 * 0.040
    slow.timings.finished = 1.5 + 10 * 0.060
    fast.status = slow.status = RequestStatus.FINISHED_LENGTH
    b.finished(fast)
    b.finished(slow)
    snapshot = b.snapshot()
    assert snapshot.num_ttft_missed == 1 and snapshot.num_itl_missed == 1
    assert snapshot.ttft_target_s == 1.0 and snapshot.itl_target_s == 0.050


def test_before_step_builds_the_queue_from_running_then_waiting_requests():
    b = budget(itl_s=0.050, ttft_s=0.5)
    running = [request(f"d{i}", 20, 0.0) for i in range(8)]
    for r in running:  # decoding: first token out, prompt computed
        r.timings.first_token = 0.01
        r.num_computed_tokens = 20
        r.output_token_ids = [1]
        r.status = RequestStatus.RUNNING
    waiting = [request("w", 300, arrival=10.0)]
    no_deadlines = b.before_step(running, now=100.0, waiting=waiting, clock_now=None)
    assert no_deadlines == b.before_step(running, now=100.0)
    due = b.before_step(running, now=100.0, waiting=waiting, clock_now=10.3)  # 0.2 s left for 300 tokens
    assert due > no_deadlines


def test_prefill_is_served_earliest_deadline_first_passed_deadlines_included():
    b = budget(ttft_s=1.0)
    long_early = request("long_early", 900, arrival=0.0)  # due at 1.0
    short_late = request("short_late", 20, arrival=0.5)  # due at 1.5
    lost = request("lost", 20, arrival=-5.0)  # due at -4.0: already missed at 0.9
    blocked = request("blocked", 20, arrival=-0.5)  # due at 0.5, plus 0.4 s blocked on its image so far
    blocked.timings.embedding_wait_since = 0.5
    recompute = request("recompute", 20, arrival=0.8)  # preempted after its first token
    recompute.timings.first_token = 0.85
    key = b.prefill_order(0.9)
    assert key is not None
    order = sorted([long_early, short_late, lost, blocked, recompute], key=key)
    assert [r.request_id for r in order] == ["recompute", "lost", "blocked", "long_early", "short_late"]


def test_prefill_is_fcfs_without_a_ttft_target_or_an_itl_target():
    assert budget(ttft_s=0.0).prefill_order(0.0) is None
    assert budget(itl_s=0.0).prefill_order(0.0) is None
    assert StepBudget(BudgetConfig(CAP)).prefill_order(0.0) is None  # not seeded yet
    assert budget().prefill_order(0.0) is not None  # auto targets: deadline order


def test_the_deadline_share_walks_the_queue_in_the_order_it_is_served():
    b = budget(itl_s=0.050)  # auto TTFT targets: a long prompt's is longer
    running = []
    for i in range(8):  # decoding
        r = request(f"d{i}", 20, 0.0)
        r.timings.first_token, r.num_computed_tokens, r.output_token_ids = 0.01, 20, [1]
        r.status = RequestStatus.RUNNING
        running.append(r)
    image = request("image", 1500, arrival=10.0)  # admitted first, 1,500 tokens left
    image.status = RequestStatus.RUNNING
    now = 10.0 + b.ttft_target_s(30) / 2
    text = request("text", 30, arrival=now - 0.01)  # due long before the image prompt
    key = b.prefill_order(now)
    assert key is not None and key(text) < key(image)
    share = b.before_step([*running, image], now=100.0, waiting=[text], clock_now=now)
    base_s, per_token_s = b.model.predict(DECODING), b.model.prefill_seconds_per_token
    fcfs = slo.pending_prompts([image, text], now, b.ttft_target_s)
    edf = slo.pending_prompts([text, image], now, b.ttft_target_s)
    # Behind the image prompt the text prompt is lost; served first it makes its deadline.
    assert deadline_share(fcfs, base_s, per_token_s, CAP) == deadline_share(fcfs[:1], base_s, per_token_s, CAP)
    saved = deadline_share(edf[:1], base_s, per_token_s, CAP)
    assert saved > 0 and share >= deadline_share(edf, base_s, per_token_s, CAP) >= saved


def test_head_share_is_the_first_prompt_whole_or_what_fits():
    assert slo.head_share([], 100) == 0
    assert slo.head_share([PendingPrompt(50, 1.0), PendingPrompt(500, 1.0)], 100) == 50
    assert slo.head_share([PendingPrompt(500, -1.0)], 100) == 100

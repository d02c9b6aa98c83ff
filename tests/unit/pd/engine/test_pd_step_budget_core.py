"""The step budget inside the real engine core: hand-made step timings, real scheduler, no model.

A runner double advances a fake timer by what a hand-made law says each step
costs, so the budget controller learns that law through the production path
(``EngineCore._run_step``) and sizes the prefill chunks the tests check.
"""

from __future__ import annotations

import pytest
from core_support import FakeClock, FakeTimer, RunnerDouble, make_core

from services.pd.engine.request import Request, SamplingParams
from services.pd.engine.step_budget import AUTO_TARGET_MULTIPLE, HEAD_STEP_MULTIPLE, BudgetConfig, StepBudget
from services.pd.engine.step_time_model import StepShape
from services.pd.step_calibration import NUM_OUTPUT_TOKENS, SHORT_PROMPT, CalibrationPlan, calibration_prompt

CAP = 64
MIN_PREFILL = 4


def law(shape: StepShape) -> float:
    """10 ms fixed, 2 ms per decode row, 0.5 ms per prefill token, 10 us per context token."""
    return (
        0.010 + 0.002 * shape.num_decode_rows + 0.0005 * shape.num_prefill_tokens + 0.00001 * shape.num_context_tokens
    )


class Engine:
    """The core with a real ``StepBudget``, whose steps take ``law`` seconds of a fake timer."""

    def __init__(self, target_itl_s: float | None, cap: int = CAP) -> None:
        self.timer = FakeTimer(100.0)
        runner = RunnerDouble()
        runner.on_step = lambda out, embeddings: self.timer.advance(law(StepShape.of_output(out)))
        self.cap = cap
        self.budget = StepBudget(BudgetConfig(cap, target_itl_s, MIN_PREFILL))
        self.core = make_core(
            clock=FakeClock(),
            runner=runner,
            step_budget=self.budget,
            timer=self.timer,
            num_blocks=512,
            max_num_batched_tokens=cap,
            max_model_len=1024,
            max_num_seqs=16,
        )
        self._next_id = 0

    def add(self, num_prompt: int, max_tokens: int) -> Request:
        self._next_id += 1
        start = 10 + 40 * self._next_id  # distinct prompts: no prefix-cache hits
        request = Request(
            f"r{self._next_id}",
            list(range(start, start + num_prompt)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        self.core.add_request(request)
        return request

    def step(self) -> list[tuple[str, int]]:
        self.core.step()
        out = self.core.scheduler.last_output
        assert out.num_batched_tokens <= self.cap
        self.core.check_integrity()
        return [(c.request_id, c.num_tokens) for c in out.chunks]

    def run(self) -> None:
        for _ in range(1000):
            if not self.core.has_work():
                return
            self.step()
        raise AssertionError("did not finish")

    def warm_up(self) -> None:
        """What the server's warm-up does: lone requests of a few prompt lengths, then a small batch."""
        for num_prompt in (16, 48, 64):
            self.add(num_prompt, max_tokens=4)
            self.run()
        for _ in range(4):
            self.add(8, max_tokens=6)
        self.run()
        assert self.budget.model.is_seeded

    def prefill_of(self, chunks: list[tuple[str, int]], request: Request) -> int:
        return dict(chunks).get(request.request_id, 0)


def test_nothing_decoding_prefills_the_whole_budget():
    engine = Engine(target_itl_s=0.001)
    engine.warm_up()
    prompt = engine.add(60, max_tokens=2)
    assert engine.step() == [(prompt.request_id, 60)]
    assert engine.budget.snapshot().prefill_budget_tokens == CAP


def test_a_decode_flood_leaves_a_waiting_prompt_its_minimum_chunk():
    engine = Engine(target_itl_s=0.001)  # far below any step: only the starvation guard lets prefill in
    engine.warm_up()
    decoders = [engine.add(8, max_tokens=40) for _ in range(6)]
    engine.step()
    prompt = engine.add(30, max_tokens=2)
    sizes = []
    while not prompt.output_token_ids:
        chunks = engine.step()
        assert all(dict(chunks)[d.request_id] == 1 for d in decoders)  # every decode row, every step
        sizes.append(engine.prefill_of(chunks, prompt))
    assert sizes == [4, 4, 4, 4, 4, 4, 4, 2]  # 30 tokens, 4 a step: the first token in bounded time
    assert engine.budget.snapshot().num_limited_steps == 7
    engine.run()


def test_target_zero_prefills_the_whole_budget_while_decoding():
    engine = Engine(target_itl_s=0.0)
    engine.warm_up()
    for _ in range(6):
        engine.add(8, max_tokens=20)
    engine.step()
    prompt = engine.add(50, max_tokens=2)
    assert engine.prefill_of(engine.step(), prompt) == 50
    assert engine.budget.snapshot().num_limited_steps == 0
    engine.run()


def test_auto_target_bounds_the_step_of_the_prompt_first_in_line():
    engine = Engine(target_itl_s=None, cap=2048)
    engine.warm_up()
    decoders = [engine.add(8, max_tokens=30) for _ in range(6)]
    for _ in range(5):
        engine.step()
    prompt = engine.add(1000, max_tokens=2)  # too long for one step of HEAD_STEP_MULTIPLE targets
    decoding = StepShape.decoding(engine.core.scheduler.running)
    expected = (HEAD_STEP_MULTIPLE * AUTO_TARGET_MULTIPLE - 1) * law(decoding) / 0.0005
    chunks = engine.step()
    assert engine.prefill_of(chunks, prompt) == pytest.approx(expected, abs=3)
    assert engine.budget.snapshot().itl_target_s == pytest.approx(AUTO_TARGET_MULTIPLE * law(decoding), rel=0.05)
    assert len(decoders) == sum(1 for _, n in chunks if n == 1)
    engine.run()


def test_engine_thread_work_between_steps_shrinks_the_next_prefill():
    """Colocated mode: a vision forward runs between two steps and the decoding streams wait through it."""
    engine = Engine(target_itl_s=0.040)
    engine.warm_up()
    for _ in range(4):
        engine.add(8, max_tokens=30)
    engine.step()
    prompt = engine.add(200, max_tokens=2)
    normal = engine.prefill_of(engine.step(), prompt)
    assert MIN_PREFILL < normal < CAP
    engine.timer.advance(0.5)  # the vision forward
    assert engine.prefill_of(engine.step(), prompt) == MIN_PREFILL
    assert engine.prefill_of(engine.step(), prompt) == pytest.approx(normal, abs=2)
    engine.run()


def test_the_step_time_model_is_measured_against_every_seeded_step():
    engine = Engine(target_itl_s=None)
    engine.warm_up()
    before = engine.budget.snapshot().ratio_bucket_counts[-1]
    engine.add(20, max_tokens=5)
    engine.run()
    snapshot = engine.core.stats().budget
    assert snapshot.ratio_bucket_counts[-1] - before == 5  # one prefill step, four decode steps
    assert snapshot.ratio_sum > 0


def test_the_warm_up_calibration_is_clipped_to_what_a_server_accepts():
    assert CalibrationPlan.for_core(make_core(clock=FakeClock())) == CalibrationPlan((16, 64, 192), 4)
    # 6 blocks of 4 = 24 tokens of KV; 20 waiting tokens; 2 waiting requests; 1 running slot.
    core = make_core(
        clock=FakeClock(),
        num_blocks=6,
        block_size=4,
        max_waiting_tokens=20,
        max_waiting_requests=2,
        max_num_seqs=1,
        max_num_batched_tokens=8,
    )
    plan = CalibrationPlan.for_core(core)
    assert plan == CalibrationPlan((16, 20), 2)
    lone = [calibration_prompt(i, n) for i, n in enumerate(plan.prompt_lengths)]
    batch = [calibration_prompt(len(lone) + i, SHORT_PROMPT) for i in range(plan.batch_size)]
    assert len({tuple(prompt[:4]) for prompt in lone + batch}) == len(lone + batch)  # no shared first block
    for group in [[prompt] for prompt in lone] + [batch]:
        for i, prompt in enumerate(group):  # accepted (the scheduler raises otherwise) and run to the end
            core.add_request(
                Request(
                    f"c{len(prompt)}-{i}-{prompt[0]}",
                    prompt,
                    SamplingParams(max_tokens=NUM_OUTPUT_TOKENS, ignore_eos=True),
                )
            )
        while core.has_work():
            core.step()
        core.check_integrity()
    assert core.scheduler.num_prefix_hit_tokens == 0

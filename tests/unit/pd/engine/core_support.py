"""The real ``EngineCore`` built for unit tests: real scheduler and caches, no model, no thread.

Doubles (named as such) stand in for what needs a model: ``RunnerDouble``
samples the tokens a test dictates and ``TokenizerDouble`` decodes ids to
words. Everything else a test drives is the production core.
"""

from __future__ import annotations

from collections.abc import Callable

from services.pd.engine.core import EngineCore
from services.pd.engine.embedding_cache import EmbeddingCache
from services.pd.engine.kv_cache import KVCacheManager
from services.pd.engine.kv_handoff import Role
from services.pd.engine.outputs import Failed, Finished, ModelRunnerOutput, SampledToken, SchedulerOutput, StepResult
from services.pd.engine.preallocated import PreallocationLimits
from services.pd.engine.scheduler import Scheduler, SchedulerConfig
from services.pd.engine.step_budget import BudgetSnapshot, StepBudget

DEFAULT_TOKEN = 7


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeTimer(FakeClock):
    """Stands in for ``time.perf_counter``: step durations are what a test (or its runner double) adds."""

    def advance(self, seconds: float) -> None:
        self.now += seconds


class PrefillBudgetDouble:
    """Stands in for ``StepBudget``: every step's prefill budget is ``next`` (None = the whole step budget)."""

    def __init__(self, max_num_batched_tokens: int) -> None:
        self.next: int | None = None
        self.key = None  # the prefill order the next step is served in (None: running, then FCFS)
        self._off = StepBudget.off(max_num_batched_tokens)

    def before_step(self, running, now: float, waiting=(), clock_now: float | None = None) -> int | None:
        return self.next

    def prefill_order(self, clock_now: float):
        return self.key

    def after_step(self, scheduler_output, started: float, ended: float) -> None:
        pass

    def first_token(self, request) -> None:
        pass

    def finished(self, request) -> None:
        pass

    def snapshot(self) -> BudgetSnapshot:
        return self._off.snapshot()


class TokenizerDouble:
    """Decodes each id to ``t<id> ``: enough for the detokenizer's deltas and stop strings."""

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"t{t} " for t in token_ids)


class RunnerDouble:
    """Samples ``tokens[request_id]`` (default ``DEFAULT_TOKEN``) for every chunk that samples.

    ``on_step(scheduler_output, embeddings)`` sees each step before it is
    "computed" (tests check what the real runner would read). Pushed
    embeddings are stored as they arrive.
    """

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.on_step: Callable[[SchedulerOutput, dict], None] | None = None
        self.omit: set[str] = set()  # requests whose sample the step "loses"
        self.num_steps = 0

    def prepare_embedding(self, embedding):
        return embedding

    def execute(self, scheduler_output: SchedulerOutput, embeddings) -> ModelRunnerOutput:
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(scheduler_output, embeddings)
        return ModelRunnerOutput(
            {
                c.request_id: SampledToken(self.tokens.get(c.request_id, DEFAULT_TOKEN))
                for c in scheduler_output.chunks
                if c.sample and c.request_id not in self.omit
            }
        )


class RecordingScheduler(Scheduler):
    """The real scheduler; keeps the output of its last ``schedule`` for the test to inspect."""

    last_output = SchedulerOutput()

    def schedule(self, prefill_budget: int | None = None, prefill_key=None) -> SchedulerOutput:
        self.last_output = super().schedule(prefill_budget, prefill_key)
        return self.last_output


def make_core(
    *,
    clock: FakeClock,
    num_blocks: int = 64,
    block_size: int = 4,
    embedding_tokens: int = 256,
    prefix_caching: bool = True,
    runner: RunnerDouble | None = None,
    hidden_size: int = 8,
    step_budget: StepBudget | PrefillBudgetDouble | None = None,
    timer: FakeTimer | None = None,
    preallocation_limits: PreallocationLimits | None = None,
    role: Role = Role.BOTH,
    **limits,
) -> EngineCore:
    """An ``EngineCore`` over real caches and a (recording) real scheduler; ``limits`` are
    ``SchedulerConfig`` fields. Without ``step_budget`` every step may prefill its whole budget."""
    limits.setdefault("max_model_len", 256)
    scheduler = RecordingScheduler(
        SchedulerConfig(**limits),
        KVCacheManager(num_blocks, block_size, prefix_caching),
        EmbeddingCache(embedding_tokens),
        clock=clock,
    )
    timing = {} if timer is None else {"timer": timer}
    return EngineCore(
        scheduler=scheduler,
        runner=runner or RunnerDouble(),
        tokenizer=TokenizerDouble(),
        hidden_size=hidden_size,
        clock=clock,
        step_budget=step_budget,
        preallocation_limits=preallocation_limits,
        role=role,
        **timing,
    )


def ended_ids(result: StepResult) -> list[str]:
    """The requests whose last event (Finished or Failed) a step produced, in order."""
    return [request_id for request_id, event in result.events if isinstance(event, (Finished, Failed))]


class EmbeddingDouble:
    """Stands in for a ``[rows, hidden]`` tensor where only its row count matters."""

    def __init__(self, rows: int, hidden: int = 8) -> None:
        self.shape = (rows, hidden)

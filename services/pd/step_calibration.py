"""Warm-up requests that seed the step-time model before PD reports ready.

The step budget (``step_budget.py``) limits prefill only once its model has
seen decode-only steps and steps with prefill (``StepTimeModel.is_seeded``).
These requests make those steps happen at start-up, through the real engine,
so that the first client's steps are already budgeted (and every path they
touch is warm):

- one request per prompt length in ``PROMPT_LENGTHS``, alone: prefill steps
  of three sizes, then decode-only steps of one row at three context lengths;
- ``BATCH_SIZE`` short requests at once: decode-only steps of several rows;
- all of it ``NUM_PASSES`` times: a shape's first step also pays one-time
  costs (kernel selection, oneDNN primitives for a new row count), which the
  model should not take for the steady state; it weighs later steps more.

Sizes are clipped to what the server's limits accept (context length, KV
pool, waiting bounds, running slots), so any configuration that can serve a
request can calibrate. On the tiny model this takes milliseconds, on the
bench model about a second of CPU. Prompts are fixed token patterns distinct
from each other, so no calibration request hits the prefix cache.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from services.pd.bridge import EngineBridge
from services.pd.engine.core import EngineCore
from services.pd.engine.outputs import Failed, Finished
from services.pd.engine.request import Request, SamplingParams

PROMPT_LENGTHS = (16, 64, 192)
"""Prompt tokens of the lone calibration requests (three prefill sizes)."""
NUM_OUTPUT_TOKENS = 4
"""Tokens each calibration request generates (its decode-only steps)."""
BATCH_SIZE = 4
"""Short requests run together for decode-only steps of several rows."""
SHORT_PROMPT = 8
"""Prompt tokens of each batched request."""
NUM_PASSES = 2
"""Times the whole calibration runs (new prompts each time: no prefix-cache hits)."""
TIMEOUT_S = 300.0
"""Longest one calibration request may take (a very slow device)."""

_FIRST_TOKEN_ID = 10  # token ids 10..249: inside any real vocabulary, away from the usual special ids
_NUM_TOKEN_IDS = 240


@dataclass(frozen=True)
class CalibrationPlan:
    """The prompt lengths and batch that fit one server's limits."""

    prompt_lengths: tuple[int, ...]
    batch_size: int

    @classmethod
    def for_core(cls, core: EngineCore) -> CalibrationPlan:
        """Clips the calibration to ``core``'s limits (call on the engine thread)."""
        config, kv = core.scheduler.config, core.kv_cache
        longest = min(config.max_model_len, kv.num_blocks * kv.block_size) - NUM_OUTPUT_TOKENS
        longest = min(longest, config.max_waiting_tokens)
        lengths = tuple(sorted({max(1, min(n, longest)) for n in PROMPT_LENGTHS}))
        batch = min(BATCH_SIZE, config.max_waiting_requests, config.max_waiting_tokens // SHORT_PROMPT)
        return cls(lengths, max(1, batch))


def calibration_prompt(index: int, length: int) -> list[int]:
    """A prompt of ``length`` ids whose first ids differ from every other ``index``'s."""
    return [
        _FIRST_TOKEN_ID + (index * 37 + position * 11 + position * position) % _NUM_TOKEN_IDS
        for position in range(length)
    ]


async def calibrate_step_time(engine: EngineBridge) -> None:
    """Runs the calibration requests to their end; raises RuntimeError if one fails."""
    plan = await engine.call(CalibrationPlan.for_core, engine.core)
    index = 0  # of the next prompt: every calibration prompt differs from the others
    for _ in range(NUM_PASSES):
        for length in plan.prompt_lengths:
            await generate(engine, _request(calibration_prompt(index, length)))
            index += 1
        short = [_request(calibration_prompt(index + i, SHORT_PROMPT)) for i in range(plan.batch_size)]
        index += plan.batch_size
        await asyncio.gather(*(generate(engine, request) for request in short))


async def generate(engine: EngineBridge, request: Request, timeout_s: float = TIMEOUT_S) -> None:
    """Runs ``request`` through the engine until it finishes; raises RuntimeError if it fails."""
    events = await engine.add_request(request)
    while True:
        event = await asyncio.wait_for(events.get(), timeout=timeout_s)
        if isinstance(event, Finished):
            return
        if isinstance(event, Failed):
            raise RuntimeError(f"warm-up generation failed: {event.error.message}")


def _request(prompt: list[int]) -> Request:
    # No EOS ids: calibration requests ignore EOS and run to NUM_OUTPUT_TOKENS.
    return Request(
        request_id=f"warmup-{uuid.uuid4().hex}",
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=NUM_OUTPUT_TOKENS, ignore_eos=True),
    )

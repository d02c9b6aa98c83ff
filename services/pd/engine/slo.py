"""The prefill a step owes the prompts waiting for their first token. Pure Python.

The step budget (``step_budget.py``) keeps decoding streams within their
inter-token latency (ITL) target. This module says when, and by how much,
waiting prompts override it, by these rules:

- **Earliest deadline first.** Prefill is served in TTFT-deadline order,
  running prefills and waiting prompts alike (``prefill_key``): a short prompt
  that arrives behind a long one in progress, such as an image prompt of
  thousands of tokens, is not held to that prompt's pace, since its target
  is shorter. A deadline already passed keeps its place: it ranks first, so
  nothing waits for ever behind prompts that arrive later (putting late
  prompts last starved them under overload). A request recomputing after a
  preemption goes before all: its stream has readers waiting already.
- **Deadlines.** Every prompt has a time-to-first-token (TTFT) deadline:
  its arrival, plus the time it spent blocked on its images (PD cannot
  prefill past an image it does not hold), plus its TTFT target. Walking
  the queue in the order the scheduler serves it, prompt ``k`` is done when
  the ``R_k`` tokens of it and of every prompt ahead of it are computed.
  ``n`` steps that do this take about ``n * base + R_k * c`` (``base``: the
  decode-only step; ``c``: seconds per prefill token). The deadline share is
  the least chunk per step, ``ceil(R_k / n_max)`` with ``n_max`` the most
  steps that still end before the deadline, that lets every prompt meet its
  deadline that can still meet it. A deadline that approaches thus wins over
  the ITL target; a distant one asks for nothing.
- **Lost deadlines do not override the ITL target.** A prompt that would
  miss its deadline even if the next step prefilled the whole cap gets no
  deadline share: a longer step does not save it, while every decoding
  stream is hurt by one. It still gets the head share below.
- **The head of the queue goes in one step.** The prompt first in line is
  prefilled whole in the next step if that step stays within
  ``HEAD_STEP_MULTIPLE`` ITL targets (``step_budget.py``), else as much of it
  as fits. A prompt spread over many steps at the ITL share costs the
  decoding streams the same prefill time in all, plus one decode step per
  chunk, and its first token comes that many steps later: behind a busy
  batch a typical prompt (an image's included) then took seconds to start,
  the decode batch stayed small, and the machine ran more, smaller steps
  for the same tokens (``epd bench compare``, bench checkpoint, 2 cores:
  image-burst throughput 1.6x, mixed-load text TTFT p50 less than half and
  ITL p50 and p99 lower with this rule than without it). The bound keeps a
  prompt of thousands of tokens from stalling every stream for seconds in
  one step; one prompt per step keeps a queue of them from doing so.
- **Queues are batched.** With ``W`` prompts waiting and ``D`` streams
  decoding, a prompt waits for every prompt ahead of it, so the queue's
  prefill share grows with ``W``. While the waiting prompts are at least
  ``QUEUE_BATCH_RATIO`` times as many as the decoding streams (a burst), the
  queue goes in whole prompts, as many as a head-share step holds (at least
  the first; ``whole_prompts``), the whole cap when nothing decodes: the
  prefill work is the same however it is split, and the decode batch fills,
  which is what a burst's throughput needs. Not the whole queue in one step:
  that made every prompt of it wait for the last one's prefill and every
  stream for the whole step (head-length steps: the text burst's ITL p99
  0.5-0.7 s against 1.6 s, its TTFT p50 0.84x). With fewer waiting prompts
  a long step would stretch many streams' gaps for few prompts, so each
  waiting prompt gets the ITL share one prompt alone would get (``W`` times
  it in all), beside the head share that starts the first of them.
- **A burst is finished as a burst.** A burst larger than the cap takes
  several steps, and after the first its own prompts are decoding streams:
  its last few prompts are then few beside many and would get one ITL share
  each, their deadlines lost by then, so the tail of the burst trickled in
  over many steps while the rest of it decoded (a burst of 32: a tenth of
  its throughput). The prefill a burst had queued is therefore owed until it
  is computed (``StepBudget`` keeps the count), and each step takes what is
  still owed, in whole prompts as above.

The step takes the largest of the ITL, head, deadline and queue shares,
never more than ``--max-num-batched-tokens`` (the hard cap) and never less
than the starvation guard (``--min-prefill-tokens``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from services.pd.engine.request import Request

MAX_PENDING_PROMPTS = 256
"""Prompts the rules look at, from the head of the queue: a step admits far fewer, and a
deep queue must not make every step walk it."""
QUEUE_BATCH_RATIO = 0.5
"""Waiting prompts per decoding stream from which the whole queue is prefilled in one step."""


PrefillKey = Callable[[Request], tuple[int, float]]
"""Orders prefill work (``prefill_key``): smaller keys are served first."""


class PendingPrompt(NamedTuple):
    """A prompt that waits for its first token, as the deadline rule sees it."""

    num_tokens: int  # prompt tokens left to compute
    slack_s: float  # seconds until its TTFT deadline (negative: passed)


def ttft_deadline(request: Request, now: float, ttft_target_s: Callable[[int], float]) -> float:
    """When ``request``'s first token is due: arrival + time blocked on images (until ``now`` if
    blocked now) + its TTFT target (``ttft_target_s`` maps a prompt's length to it)."""
    timings = request.timings
    blocked_s = timings.embedding_wait_s
    if timings.embedding_wait_since is not None:
        blocked_s += max(0.0, now - timings.embedding_wait_since)
    return timings.arrival + blocked_s + ttft_target_s(request.num_prompt_tokens)


def prefill_key(now: float, ttft_target_s: Callable[[int], float]) -> PrefillKey:
    """The order prefill is served in (module docstring: "Earliest deadline first")."""

    def key(request: Request) -> tuple[int, float]:
        if request.timings.first_token is not None:
            return (0, request.timings.arrival)  # a preempted stream recomputing: its reader waits already
        return (1, ttft_deadline(request, now, ttft_target_s))

    return key


def pending_prompts(
    requests: Iterable[Request], now: float, ttft_target_s: Callable[[int], float]
) -> list[PendingPrompt]:
    """The prompts of ``requests`` (in scheduling order) still waiting for their first token.

    ``now`` is on the clock of the requests' timings; ``ttft_target_s`` maps a
    prompt's length to its TTFT target.

    Requests that already produced a token (decoding, or recomputing after a
    preemption) have no TTFT deadline left; requests blocked on an image are
    left out (nothing past the image can be computed until it arrives).
    """
    out: list[PendingPrompt] = []
    for request in itertools.islice(requests, MAX_PENDING_PROMPTS * 4):
        if len(out) == MAX_PENDING_PROMPTS:
            break
        if request.timings.first_token is not None or request.timings.embedding_wait_since is not None:
            continue
        remaining = request.num_prompt_tokens - request.num_computed_tokens
        if remaining <= 0:
            continue
        out.append(PendingPrompt(remaining, ttft_deadline(request, now, ttft_target_s) - now))
    return out


def deadline_share(
    queue: Sequence[PendingPrompt], base_s: float, per_token_s: float, cap: int, since_last_step_s: float = 0.0
) -> int:
    """Least prefill tokens per step that let every prompt that can still meet its deadline meet it.

    ``base_s``: the predicted decode-only step; ``per_token_s``: what one
    prefill token adds to a step; ``since_last_step_s``: engine-thread time
    already spent before the next step starts. 0 when no deadline needs more
    than nothing (or nothing can be predicted).
    """
    if per_token_s <= 0:
        return 0
    need = 0
    cumulative = 0
    for prompt in queue:
        cumulative += prompt.num_tokens
        slack_s = prompt.slack_s - since_last_step_s
        if slack_s == math.inf:
            continue  # no target (off, or not predictable yet)
        work_s = cumulative * per_token_s
        fewest_steps = math.ceil(cumulative / cap)
        if fewest_steps * base_s + work_s > slack_s:
            continue  # lost: not even whole-cap steps from now make it
        most_steps = math.floor((slack_s - work_s) / base_s) if base_s > 0 else cumulative
        need = max(need, math.ceil(cumulative / max(1, most_steps)))
    return min(cap, need)


def head_share(queue: Sequence[PendingPrompt], fits: int) -> int:
    """The prompt at the head of the queue, whole, if it fits in ``fits`` tokens; else ``fits`` of it
    (module docstring: "The head of the queue goes in one step"). 0 with nothing waiting."""
    return min(queue[0].num_tokens, fits) if queue else 0


def whole_prompts(queue: Sequence[PendingPrompt], fits: int) -> int:
    """The tokens of the queue's leading prompts that fit in ``fits`` tokens whole, at least the first one's."""
    total = 0
    for prompt in queue:
        if total and total + prompt.num_tokens > fits:
            break
        total += prompt.num_tokens
    return total


def is_burst(num_waiting: int, num_decoding: int) -> bool:
    """Whether this many waiting prompts beside this many decoding streams are prefilled as one batch."""
    return num_waiting >= 2 and num_waiting >= QUEUE_BATCH_RATIO * num_decoding


def queue_share(queue: Sequence[PendingPrompt], itl_share: int, cap: int, num_decoding: int) -> int:
    """The prefill the waiting prompts claim together (module docstring: "Queues are batched")."""
    num_waiting = len(queue)
    if num_waiting < 2:
        return 0
    needed = sum(prompt.num_tokens for prompt in queue)
    if is_burst(num_waiting, num_decoding):
        return min(cap, needed)
    return min(cap, itl_share * num_waiting, needed)

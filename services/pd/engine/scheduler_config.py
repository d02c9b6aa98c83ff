"""The scheduler's limits, the requests they refuse, and the refusal it answers when they are reached. Pure Python."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.pd.engine import spans
from services.pd.engine.request import Request


class QueueFull(Exception):
    """Too much is waiting already (gRPC RESOURCE_EXHAUSTED with a retry hint)."""

    def __init__(self, retry_after_s: float):
        super().__init__(f"waiting queue full; retry after {retry_after_s:.2f}s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one PD's scheduler."""

    max_model_len: int  # prompt + output tokens of one request
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64  # requests holding KV at once
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 262144  # prompt (+ output, if preempted) tokens of all waiting requests
    retry_after_s: float = 1.0  # hint returned with QueueFull
    # While prompts wait for admission, running prefills take at most half of a
    # limited prefill share, so a long prompt in progress does not hold up the
    # short ones behind it (head-of-line blocking); off: strict FCFS chunks.
    share_prefill_with_queue: bool = False

    def __post_init__(self) -> None:
        if (
            min(
                self.max_model_len,
                self.max_num_batched_tokens,
                self.max_num_seqs,
                self.max_waiting_requests,
                self.max_waiting_tokens,
            )
            <= 0
        ):
            raise ValueError("scheduler limits must be positive")


def validate_request(
    request: Request, config: SchedulerConfig, num_blocks_for: Callable[[int], int], num_kv_blocks: int
) -> None:
    """Raises ValueError for a request this server can never run (empty or too long prompt, bad
    spans, more KV than the ``num_kv_blocks`` blocks there are; ``num_blocks_for``: blocks per tokens)."""
    if not request.prompt_token_ids:
        raise ValueError("the prompt is empty")
    if request.num_prompt_tokens > config.max_model_len:
        raise ValueError("the prompt is longer than the maximum model length")
    if request.num_prompt_tokens > config.max_waiting_tokens:
        raise ValueError("the prompt is longer than this server's waiting-queue token bound")
    if request.sampling.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    spans.validate_spans(request.mm_spans, request.num_prompt_tokens)
    max_len = min(config.max_model_len, request.num_prompt_tokens + request.sampling.max_tokens)
    # The last token is sampled, never computed, so it needs no KV.
    if num_blocks_for(max_len - 1) > num_kv_blocks:
        raise ValueError("the request needs more KV cache than this server has")

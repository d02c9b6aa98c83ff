"""The scheduler's limits, and the refusal it answers when they are reached. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass


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

"""The integrity check shared by the PD policy code (``check_integrity`` methods), and the scheduler's queues'."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from services.pd.engine.request import Request, RequestStatus

_RUNNING_STATES = (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_EMBEDDING)
_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_EMBEDDING)


def check(condition: bool, message: str) -> None:
    """Raise AssertionError with ``message`` when an invariant is violated."""
    if not condition:
        raise AssertionError(message)


def check_queued_request(request: Request, *, running: bool, block_size: int) -> None:
    """Raise AssertionError unless a request in the scheduler's running (or waiting) queue is consistent."""
    if running:
        check(request.status in _RUNNING_STATES, "bad status in running")
        check(request.num_computed_tokens < request.num_tokens, "nothing left to compute")
        check(
            len(request.block_ids) * block_size >= request.num_computed_tokens,
            "block table shorter than the computed tokens",
        )
    else:
        check(request.status in _WAITING_STATES, "bad status in waiting")
        check(not request.block_ids and request.num_computed_tokens == 0, "a waiting request holds KV")
    check(all(0 <= i < len(request.mm_spans) for i in request.span_refs), "span reference out of range")
    check(request.cached_prefix is None or not request.block_ids, "a cached prefix outlived admission")
    # Preemption keeps the output and recomputes KV only, so the matcher never has to move back.
    check(
        request.grammar is None or request.grammar.num_accepted_tokens == len(request.output_token_ids),
        "a grammar has not accepted exactly the output",
    )


def check_queues(
    running: Sequence[Request],
    waiting: Sequence[Request],
    request_ids: Collection[str],
    max_num_seqs: int,
    block_size: int,
) -> None:
    """Raise AssertionError unless the scheduler's queues hold exactly ``request_ids``, once each, at most
    ``max_num_seqs`` of them holding a slot (running, not waiting for an image), each consistent."""
    queued = [r.request_id for r in running] + [r.request_id for r in waiting]
    check(len(queued) == len(set(queued)) and set(queued) == set(request_ids), "queues and the request table disagree")
    num_active = sum(r.status is not RequestStatus.WAITING_FOR_EMBEDDING for r in running)
    check(num_active <= max_num_seqs, "too many running requests")
    for request in running:
        check_queued_request(request, running=True, block_size=block_size)
    for request in waiting:
        check_queued_request(request, running=False, block_size=block_size)

"""Typed hand-offs between the scheduler, the model runner, the engine core and its callers.

``SchedulerOutput`` says what to compute in one step; ``ModelRunnerOutput``
says what was sampled; ``RequestEvent``s are what the core tells each
request's stream; ``Allocation`` is Preallocate's answer. All plain data: no
tensors cross the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from services.pd.engine.errors import EngineError
from services.pd.engine.positions import MRopePlan
from services.pd.engine.request import Grammar, Request, RequestStatus, SamplingParams, TokenHistory


@dataclass(frozen=True)
class ImageSlice:
    """Embedding rows to splice into a chunk.

    Rows ``[src_start, src_start + length)`` of the embedding ``mm_hash`` replace
    the token embeddings at chunk-local positions ``[dst_start, dst_start + length)``.
    A prefill chunk may split an image span, so a slice can be a part of one.
    """

    mm_hash: str
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens of one request computed in one step.

    ``token_ids`` sit at absolute positions ``start_pos .. start_pos + len - 1``;
    their K/V are written to ``block_ids`` (the request's whole block table,
    covering at least ``start_pos + len`` tokens). When ``sample`` is true the
    runner samples the next token from the chunk's last position.
    ``rope`` gives the tokens' multimodal rotary positions (None: the absolute
    positions); the runner uses it when its model takes 3-D positions.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    image_slices: list[ImageSlice] = field(default_factory=list)
    sample: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_output_tokens: int = 0  # tokens generated so far (seeds per-step RNG)
    masked_token_ids: tuple[int, ...] = ()  # ids the sample must not take (stop tokens before min_tokens)
    history: TokenHistory | None = None  # what the penalties look at; None = no penalty (sampling chunks only)
    rope: MRopePlan | None = None  # the request's plan (shared, immutable), not just this chunk's
    grammar: Grammar | None = None  # the request's matcher, whose mask the sample obeys (sampling chunks only)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What to compute in one step, in batch order.

    ``finished_request_ids`` ended since the last step, so the runner can drop
    per-request state. ``failed_request_ids`` cannot go on (an image they
    still need is gone from the embedding cache): the engine core ends them
    before the step runs. ``preempted_request_ids`` lost their KV this step.
    ``stalled``: the waiting request that found no KV room while nothing ran
    (pinned blocks hold it: the engine core lets go of other waiting ones').
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    failed_request_ids: list[str] = field(default_factory=list)
    stalled: str | None = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SampledToken:
    """One sampled token, with its logprob and top alternatives when asked for."""

    token_id: int
    logprob: float | None = None
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, keyed by request id (chunks with ``sample``)."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)


@dataclass(frozen=True)
class Allocation:
    """Preallocate's answer for one item.

    READY items need no push: their embedding is cached here (pinned until
    Generate) or, with ``via_prefix_cache``, their K/V is (the id then names a
    pin of prefix blocks and is never a push target). RESERVED items wait for
    the encoder's push to ``reservation_id``.
    """

    mm_hash: str
    ready: bool
    reservation_id: str
    via_prefix_cache: bool = False


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request since its last event."""

    token_ids: list[int]
    text: str
    logprobs: list[SampledToken] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    """The request ended normally (or was aborted); carries the final request state."""

    status: RequestStatus
    request: Request


@dataclass(frozen=True)
class Failed:
    """The request ended with an error."""

    error: EngineError


Event = TokenDelta | Finished | Failed


class RequestEvent(NamedTuple):
    """One event of one request, as the engine core hands it to whoever streams it."""

    request_id: str
    event: Event


class StepResult(NamedTuple):
    """What one ``EngineCore.step`` produced."""

    events: list[RequestEvent]  # in order; a request's last event is Finished or Failed
    executed: bool  # a model step ran (False: nothing could be scheduled)

"""Typed hand-offs between the scheduler, the model runner and the engine.

``SchedulerOutput`` says what to compute in one step; ``ModelRunnerOutput``
says what was sampled. Both are plain data: no tensors cross the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.pd.positions import MRopePlan
from services.pd.request import SamplingParams


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
    num_output_tokens: int = 0   # tokens generated so far (seeds per-step RNG)
    rope: MRopePlan | None = None  # the request's plan (shared, immutable), not just this chunk's

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What to compute in one step, in batch order.

    ``finished_request_ids`` were freed since the last step, so the runner
    can drop per-request state (RNGs).
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)

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

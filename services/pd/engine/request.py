"""The one carrier of per-request state on PD.

The scheduler changes counters and ids here, never tensors. Pure Python.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from services.pd.engine.positions import MRopePlan, build_plan


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Ordered: ``status >= FINISHED_STOPPED`` means finished."""

    WAITING = 0
    WAITING_FOR_EMBEDDING = 1  # admitted, but the next prefill chunk needs an image not READY
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4  # EOS, stop token or stop string
    FINISHED_LENGTH = 5  # max_tokens or context length
    FINISHED_ABORTED = 6  # client abort / cancellation
    FINISHED_ERROR = 7  # lease expired, engine failure, ...

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class Run(NamedTuple):
    """Consecutive prompt positions that take consecutive rows of one embedding."""

    offset: int  # prompt index of the first position
    row: int  # the embedding row it takes
    length: int


@dataclass(frozen=True)
class MultiModalSpan:
    """An image in the prompt: ``num_tokens`` positions from ``offset`` take its embedding rows.

    ``grid`` is the image's ``(t, h, w)`` layout in LM tokens (``t * h * w ==
    num_tokens``) for models with multimodal RoPE (Qwen2-VL family), which
    gives its tokens 3-D rotary positions (``positions.py``); None otherwise.
    ``time_step`` spaces a video's temporal positions (1 for images).
    ``frame_offsets`` (Qwen3-VL videos, whose frames text separates): where
    each of the grid's ``t`` temporal patches starts, ``num_tokens / t`` rows
    each (``runs``); empty when the rows are one run from ``offset``. The span
    covers ``[offset, end)``, the text between its runs included.
    """

    mm_hash: str
    offset: int
    num_tokens: int
    grid: tuple[int, int, int] | None = None
    time_step: float = 1.0
    frame_offsets: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        if self.frame_offsets:
            return self.frame_offsets[-1] + self.num_tokens // len(self.frame_offsets)
        return self.offset + self.num_tokens

    def runs(self) -> list[Run]:
        """Where its rows go: one run, or one per temporal patch (``frame_offsets``)."""
        if not self.frame_offsets:
            return [Run(self.offset, 0, self.num_tokens)]
        length = self.num_tokens // len(self.frame_offsets)
        return [Run(offset, k * length, length) for k, offset in enumerate(self.frame_offsets)]


@dataclass(frozen=True)
class CachedPrefix:
    """The longest prefix of a request found in the prefix cache: ``block_ids`` hold
    its first ``num_tokens`` tokens (whole blocks)."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0

    def covers(self, span: MultiModalSpan) -> bool:
        """Whether the span's K/V is entirely inside this prefix."""
        return span.end <= self.num_tokens


class TokenHistory(NamedTuple):
    """A request's tokens as its penalties see them (``Request.penalty_history``)."""

    prompt_token_ids: Sequence[int]  # empty when only the output counts
    output_token_ids: Sequence[int]


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What a constrained request's output must match (domain form of ``epd.v1.StructuredOutput``).

    ``kind`` names the constraint as the wire's oneof does (``json_schema``,
    ``json_object``, ``regex``, ``choice``, ``grammar``); ``value`` is the schema
    (serialized JSON), the regex, the EBNF grammar, or the choices as a JSON
    list ("" for ``json_object``). Hashable: compiled grammars are cached by it.
    """

    kind: str
    value: str = ""


class Grammar(Protocol):
    """A request's matcher as the engine sees it (``runner/grammar.py`` implements it).

    It has accepted exactly the request's output tokens (``num_accepted_tokens``),
    so a preempted request, which keeps its output and recomputes only KV, needs
    nothing done to it.
    """

    num_accepted_tokens: int

    def accept(self, token_id: int) -> bool:
        """Advances past ``token_id``; False, changing nothing, when the grammar forbids it."""
        ...

    @property
    def is_terminated(self) -> bool:
        """Whether the output is complete (the grammar ended and a stop token was accepted)."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (domain form of ``epd.v1.SamplingParams``)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # <= 0 = disabled
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token
    # The first min_tokens outputs are never a stop: EOS and stop tokens are masked out of their
    # sampling and a stop string ends the request only from output min_tokens + 1 on (<= max_tokens).
    min_tokens: int = 0
    # Penalties over the request's history (vLLM's): repetition over prompt and output tokens
    # (1.0 = off), presence and frequency over output tokens only (0.0 = off).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (random rows; 0 = off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), by id
    # Detokenizer options (vLLM's); include_stop_str_in_output also keeps a stop token's text.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (None = free text); the request's ``grammar`` is compiled from it before admission.
    structured_output: StructuredOutputSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the request's token history (``Request.penalty_history``)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class Timings:
    """Wall-clock stamps (``time.monotonic()``) of a request's stages."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    embedding_wait_s: float = 0.0  # accumulated time blocked on images
    embedding_wait_since: float | None = None


@dataclass
class Request:
    """A generation request as the engine sees it.

    ``prompt_token_ids`` already contains one placeholder token per image
    embedding row; ``mm_spans`` say where the rows go. ``num_computed_tokens``
    counts tokens of ``all_token_ids`` whose KV is in the cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mm_spans: list[MultiModalSpan] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()  # every id that ends the request (a checkpoint may name several)
    # The tenant's cache salt ("" = none, else 64 hex characters): it seeds the first block's prefix-cache
    # key, so tenants never share KV (their images differ already: the salt is in their mm_hash).
    cache_salt: str = ""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    error: str | None = None  # set with FINISHED_ERROR
    timings: Timings = field(default_factory=Timings)
    # Chained prefix-cache keys of the full blocks of all_token_ids, filled
    # lazily by KVCacheManager (valid for the request's whole life: tokens only append).
    block_hashes: list[bytes] = field(default_factory=list)
    # Indices into mm_spans whose embedding this request holds an EmbeddingCache
    # reference on (one per span). Once its images are computed, pinned K/V
    # through them stands in for these (``EngineCore._let_go_of_computed_images``),
    # so a preempted request can always recompute its images.
    span_refs: set[int] = field(default_factory=set)
    # The prefix-cache hit, looked up once (``KVCacheManager.claim_cached_prefix``)
    # and carried to admission; None = not looked up since the last admission.
    cached_prefix: CachedPrefix | None = None
    # Multimodal RoPE positions (rope_plan() fills it on first use when a
    # span has a grid); None = positions are the token indices.
    rope_plan: MRopePlan | None = None
    # The matcher of ``sampling.structured_output``, set before admission (the servicer compiles it off
    # the engine thread); the sampler masks what it forbids and every sampled token advances it. Dropped
    # on release.
    grammar: Grammar | None = None
    # A prefill instance's half of a KV hand-off: once finished (its first token sampled), its prompt
    # blocks are held for the push to the decode instance instead of freed (``handoff_core.py``).
    hand_off_kv: bool = False
    # K/V that came over the wire (the decode side of a KV hand-off, ``handoff_core.py``): its blocks from
    # ``private_kv_from`` on are keyed in the prefix cache under this random salt, so only this request
    # (re-admitted after a preemption) can ever find them again; no other request is served K/V that a
    # caller pushed. b"" = every key is the shared one.
    private_kv_salt: bytes = b""
    private_kv_from: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_image_tokens(self) -> int:
        return sum(span.num_tokens for span in self.mm_spans)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def stop_status(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """How the request ends now that ``token_id`` is its last output token; None: it goes on."""
        sampling = self.sampling
        # Within min_tokens a stop token is not a stop (the sampler masks them; this holds even if it did not).
        may_stop = len(self.output_token_ids) > sampling.min_tokens
        if may_stop and not sampling.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if may_stop and token_id in sampling.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.is_terminated:  # complete: only a stop could follow
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= sampling.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def masked_token_ids(self) -> tuple[int, ...]:
        """Token ids its next sample must not take: its stop tokens while ``min_tokens`` are not reached.

        The stop tokens are every EOS id (unless ``ignore_eos``) and ``stop_token_ids``;
        masking them is transformers' ``MinNewTokensLengthLogitsProcessor``.
        """
        sampling = self.sampling
        if len(self.output_token_ids) >= sampling.min_tokens:
            return ()
        eos = () if sampling.ignore_eos else self.eos_token_ids
        return eos + sampling.stop_token_ids

    @property
    def penalty_history(self) -> TokenHistory | None:
        """The tokens its penalties look at, or None when it uses none (most requests).

        The prompt only when ``repetition_penalty`` is on (presence and
        frequency look at the output alone); it is the request's own list (a
        prompt never changes), the output a snapshot (it grows after the step).
        """
        sampling = self.sampling
        if not sampling.uses_penalties:
            return None
        prompt = self.prompt_token_ids if sampling.repetition_penalty != 1.0 else ()
        return TokenHistory(prompt, tuple(self.output_token_ids))

    @property
    def is_decoding(self) -> bool:
        """Whether its next step computes one token and samples (a decode row, not a prefill chunk)."""
        return (
            self.status is RequestStatus.RUNNING
            and bool(self.output_token_ids)
            and self.num_computed_tokens == self.num_tokens - 1
        )


def rope_plan(request: Request) -> MRopePlan | None:
    """The request's M-RoPE plan, computed on first use and kept on the request; None for 1-D positions."""
    if request.rope_plan is None and any(span.grid is not None for span in request.mm_spans):
        request.rope_plan = build_plan(request.mm_spans, request.num_prompt_tokens)
    return request.rope_plan

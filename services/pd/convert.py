"""Proto <-> domain conversion for PD, and the one table of error codes.

Validation of everything that arrives over the wire happens here, so the
engine only ever sees well-formed requests. Messages never echo input.
A Generate's sampling parameters are converted in ``sampling_convert``.
"""

from __future__ import annotations

import math
import re
import struct
import time
from collections.abc import Mapping, Sequence

import grpc

from services.common import hashing
from services.common.grids import grid_from_pb
from services.common.pb import epd_pb2
from services.pd.engine.engine_stats import EngineStats
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.outputs import Allocation, Finished, SampledToken, TokenDelta
from services.pd.engine.request import MultiModalSpan, Request, RequestStatus, rope_plan
from services.pd.sampling_convert import sampling_from_pb

STATUS_CODES: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
}

FINISH_REASONS: dict[RequestStatus, epd_pb2.FinishReason] = {
    RequestStatus.FINISHED_STOPPED: epd_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: epd_pb2.FINISH_REASON_LENGTH,
}

MAX_REQUEST_ID_LEN = 128
MAX_ITEMS = 64
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII: ids end up in logs and metadata
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_MAX_SECONDS_PER_PATCH = 3600.0  # a temporal patch is two frames: even 1 frame an hour is far below


def _invalid(message: str) -> EngineError:
    return EngineError(ErrorKind.INVALID_ARGUMENT, message)


def check_request_id(request_id: str) -> str:
    if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise _invalid(f"request_id must be 1..{MAX_REQUEST_ID_LEN} characters")
    if not _REQUEST_ID_RE.fullmatch(request_id):
        raise _invalid("request_id must be printable ASCII without spaces or control characters")
    return request_id


def check_cache_salt(cache_salt: str) -> str:
    """The wire salt (``""`` or a 64-hex digest) if well formed; INVALID_ARGUMENT otherwise, the value not echoed."""
    try:
        return hashing.check_cache_salt(cache_salt)
    except ValueError as error:
        raise _invalid(str(error)) from None


def check_prompt(prompt_token_ids: Sequence[int], *, vocab_size: int, max_model_len: int) -> None:
    """A prompt this model can run: non-empty, shorter than the context, ids inside the vocabulary."""
    if not prompt_token_ids:
        raise _invalid("prompt_token_ids must not be empty")
    if len(prompt_token_ids) >= max_model_len:
        raise _invalid(f"prompt has {len(prompt_token_ids)} tokens; this model's context is {max_model_len}")
    if max(prompt_token_ids) >= vocab_size:
        raise _invalid("prompt_token_ids contains an id outside the vocabulary")


def spans_from_pb(
    items: Sequence[epd_pb2.MultiModalItem],
    prompt_len: int,
    *,
    max_items: int = MAX_ITEMS,
    uses_grids: bool | None = None,
    tokens_per_second: float | None = None,
) -> list[MultiModalSpan]:
    """Validates image items: not too many, well-formed hashes, inside the prompt, sorted, non-overlapping.

    A grid, when set, must multiply to ``num_tokens``. ``uses_grids`` (the
    model's multimodal RoPE) requires every item to carry one (True) or none
    (False); None accepts either. A video (``second_per_grid_t`` set) gets its
    temporal step: ``tokens_per_second * second_per_grid_t`` (Qwen2.5-VL), 1
    when the model has no such rate (Qwen2-VL). ``frame_offsets`` (Qwen3-VL
    videos) must name one increasing, non-overlapping run per temporal patch,
    the first at ``offset``.
    """
    if len(items) > max_items:
        raise _invalid(f"at most {max_items} images per request")
    spans = []
    end = 0
    for index, item in enumerate(items):
        if not _HASH_RE.match(item.mm_hash):
            raise _invalid(f"item {index}: mm_hash must be 64 lowercase hex characters")
        if item.num_tokens == 0:
            raise _invalid(f"item {index}: num_tokens must be positive")
        if item.offset < end:
            raise _invalid(f"item {index}: image spans must be sorted and must not overlap")
        grid = _grid(item, index, uses_grids)
        step = video_time_step(item, index, grid, tokens_per_second)
        span = MultiModalSpan(item.mm_hash, item.offset, item.num_tokens, grid, step, _frame_offsets(item, index, grid))
        if span.end > prompt_len:
            raise _invalid(f"item {index}: image span extends past the prompt")
        spans.append(span)
        end = span.end
    return spans


def _frame_offsets(item: epd_pb2.MultiModalItem, index: int, grid: tuple[int, int, int] | None) -> tuple[int, ...]:
    """An item's ``frame_offsets``, checked: one run of ``num_tokens / t`` rows per temporal patch of its
    grid, the first at ``offset``, each after the end of the one before."""
    offsets = tuple(item.frame_offsets)
    if not offsets:
        return ()
    if grid is None or len(offsets) != grid[0] or offsets[0] != item.offset:
        raise _invalid(f"item {index}: frame_offsets needs one offset per temporal patch, the first at offset")
    length = item.num_tokens // grid[0]
    if any(later < earlier + length for earlier, later in zip(offsets, offsets[1:])):
        raise _invalid(f"item {index}: frame_offsets must increase by at least a frame's tokens")
    return offsets


def video_time_step(
    item: epd_pb2.MultiModalItem, index: int, grid: tuple[int, int, int] | None, tokens_per_second: float | None
) -> float:
    """The spacing of an item's temporal positions: 1 for an image; for a video (``second_per_grid_t`` set)
    ``tokens_per_second * second_per_grid_t`` in float32, or 1 for a model without a rate (Qwen2-VL)."""
    if not item.HasField("second_per_grid_t"):
        return 1.0
    seconds = item.second_per_grid_t
    if grid is None:
        raise _invalid(f"item {index}: a video needs a grid")
    if not (math.isfinite(seconds) and 0 < seconds <= _MAX_SECONDS_PER_PATCH):
        raise _invalid(f"item {index}: second_per_grid_t must be in (0, {_MAX_SECONDS_PER_PATCH}]")
    if tokens_per_second is None:
        return 1.0
    # transformers multiplies the config's rate by a float32 tensor: the step is a float32.
    return struct.unpack("f", struct.pack("f", tokens_per_second * seconds))[0]


def _grid(item: epd_pb2.MultiModalItem, index: int, uses_grids: bool | None) -> tuple[int, int, int] | None:
    try:
        grid = grid_from_pb(item)
    except ValueError:
        raise _invalid(f"item {index}: grid dimensions must be positive") from None
    if grid is not None and grid[0] * grid[1] * grid[2] != item.num_tokens:
        raise _invalid(f"item {index}: grid t*h*w must equal num_tokens")
    if uses_grids is not None and (grid is not None) != uses_grids:
        raise _invalid(f"item {index}: this model {'needs' if uses_grids else 'takes no'} image grids")
    return grid


def request_from_pb(
    message: epd_pb2.GenerateRequest,
    *,
    eos_token_ids: tuple[int, ...],
    vocab_size: int,
    max_model_len: int,
    max_items: int = MAX_ITEMS,
    uses_grids: bool | None = None,
    tokens_per_second: float | None = None,
) -> Request:
    """Builds an engine ``Request`` from a validated ``GenerateRequest``.

    ``uses_grids``: see ``spans_from_pb``. A request whose items carry grids
    gets its multimodal-RoPE positions planned here, once.
    """
    check_request_id(message.request_id)
    cache_salt = check_cache_salt(message.cache_salt)
    prompt = list(message.prompt_token_ids)
    check_prompt(prompt, vocab_size=vocab_size, max_model_len=max_model_len)
    sampling = sampling_from_pb(message.sampling, max_tokens_cap=max_model_len - len(prompt))
    if any(t >= vocab_size for t in sampling.stop_token_ids):
        # They would index the logits (masked before min_tokens); the model cannot produce them anyway.
        raise _invalid("stop_token_ids contains an id outside the vocabulary")
    if any(t >= vocab_size for t, _ in sampling.logit_bias):
        raise _invalid("logit_bias names an id outside the vocabulary")  # it would index the logits
    request = Request(
        request_id=message.request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        mm_spans=spans_from_pb(
            message.mm_items,
            len(prompt),
            max_items=max_items,
            uses_grids=uses_grids,
            tokens_per_second=tokens_per_second,
        ),
        eos_token_ids=eos_token_ids,
        cache_salt=cache_salt,
    )
    rope_plan(request)
    return request


def preallocate_to_pb(allocations: Sequence[Allocation], lease_ms: int) -> epd_pb2.PreallocateResponse:
    ready, reserved = epd_pb2.ItemAllocation.READY, epd_pb2.ItemAllocation.RESERVED
    return epd_pb2.PreallocateResponse(
        items=[
            epd_pb2.ItemAllocation(
                mm_hash=a.mm_hash, state=ready if a.ready else reserved, reservation_id=a.reservation_id
            )
            for a in allocations
        ],
        lease_ms=lease_ms,
    )


def delta_to_pb(delta: TokenDelta) -> epd_pb2.GenerateResponse:
    return epd_pb2.GenerateResponse(
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=[
            epd_pb2.TokenLogprob(
                token_id=s.token_id,
                logprob=s.logprob or 0.0,
                top_token_ids=list(s.top_token_ids),
                top_logprobs=list(s.top_logprobs),
            )
            for s in delta.logprobs
        ],
    )


def first_token_from_pb(header: epd_pb2.KVHeader, vocab_size: int) -> SampledToken:
    """A KV push's first token, with its logprobs when sent; INVALID_ARGUMENT for ids outside the vocabulary."""
    ids = [header.first_token_id]
    logprob = header.first_token_logprob if header.HasField("first_token_logprob") else None
    if logprob is not None:
        ids += [logprob.token_id, *logprob.top_token_ids]
        if len(logprob.top_token_ids) != len(logprob.top_logprobs) or logprob.token_id != header.first_token_id:
            raise _invalid("first_token_logprob does not match the first token")
    if any(token_id >= vocab_size for token_id in ids):
        raise _invalid("a first token id is outside the vocabulary")
    if logprob is None:
        return SampledToken(header.first_token_id)
    return SampledToken(
        header.first_token_id, logprob.logprob, tuple(logprob.top_token_ids), tuple(logprob.top_logprobs)
    )


def final_to_pb(finished: Finished) -> epd_pb2.GenerateResponse:
    usage = usage_of(finished.request)
    return epd_pb2.GenerateResponse(
        finish_reason=FINISH_REASONS.get(finished.status, epd_pb2.FINISH_REASON_STOP),
        usage=epd_pb2.Usage(
            prompt_tokens=int(usage["prompt_tokens"]),
            completion_tokens=int(usage["completion_tokens"]),
            cached_tokens=int(usage["cached_tokens"]),
            image_tokens=int(usage["image_tokens"]),
            timings=epd_pb2.StageTimings(
                queue_ms=usage["queue_ms"],
                embedding_wait_ms=usage["embedding_wait_ms"],
                prefill_ms=usage["prefill_ms"],
                decode_ms=usage["decode_ms"],
            ),
        ),
    )


def load_to_pb(stats: EngineStats) -> epd_pb2.PdLoad:
    return epd_pb2.PdLoad(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_kv_blocks_used=stats.num_kv_blocks_used,
        num_kv_blocks_total=stats.num_kv_blocks_total,
        embedding_tokens_reserved=stats.reserved_tokens,
        embedding_tokens_ready=stats.ready_tokens,
        embedding_tokens_capacity=stats.capacity_tokens,
        num_reservations=stats.num_reservations,
        num_running_tokens=stats.num_running_tokens,
        num_waiting_tokens=stats.num_waiting_tokens,
    )


def usage_of(request: Request) -> Mapping[str, float]:
    """Token counts and per-stage timings (ms) of a finished request."""
    t = request.timings
    first_scheduled = t.first_scheduled or t.arrival
    first_token = t.first_token or first_scheduled
    finished = t.finished or time.monotonic()
    return {
        "prompt_tokens": request.num_prompt_tokens,
        "completion_tokens": len(request.output_token_ids),
        "cached_tokens": request.num_cached_tokens,
        "image_tokens": request.num_image_tokens,
        "queue_ms": (first_scheduled - t.arrival) * 1000.0,
        "embedding_wait_ms": t.embedding_wait_s * 1000.0,
        "prefill_ms": max(0.0, first_token - first_scheduled) * 1000.0,
        "decode_ms": max(0.0, finished - first_token) * 1000.0,
    }

"""How a request's tokens and image spans map onto chunks.

Pure Python helpers of the scheduler: how far a chunk can go before an image
that is not ready, which token ids and image rows it covers, and how long a
request waited for its images. Nothing here decides what to schedule.
"""

from __future__ import annotations

from collections.abc import Callable

from services.pd.engine.outputs import ImageSlice, ScheduledChunk
from services.pd.engine.request import MultiModalSpan, Request, RequestStatus, rope_plan


def validate_spans(spans: list[MultiModalSpan], num_prompt_tokens: int) -> None:
    end = 0
    for span in spans:
        if span.num_tokens <= 0 or span.offset < end or span.end > num_prompt_tokens:
            raise ValueError("image spans must be non-empty, sorted, disjoint and inside the prompt")
        end = span.end


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating the whole sequence."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    if start >= num_prompt:
        return output[start - num_prompt : end - num_prompt]
    return prompt[start:] + output[: end - num_prompt]


def image_slices(spans: list[MultiModalSpan], start: int, end: int) -> list[ImageSlice]:
    """The parts of image spans inside positions ``[start, end)``, chunk-local (a video whose frames
    text separates gives a slice per run)."""
    slices = []
    for span in spans:
        if span.end <= start or span.offset >= end:
            continue
        for run in span.runs():
            lo, hi = max(start, run.offset), min(end, run.offset + run.length)
            if lo < hi:
                src_start = run.row + lo - run.offset
                slices.append(ImageSlice(span.mm_hash, src_start=src_start, dst_start=lo - start, length=hi - lo))
    return slices


def mark_blocked(request: Request, now: float) -> None:
    request.status = RequestStatus.WAITING_FOR_EMBEDDING
    if request.timings.embedding_wait_since is None:
        request.timings.embedding_wait_since = now


def end_embedding_wait(request: Request, now: float) -> None:
    since = request.timings.embedding_wait_since
    if since is not None:
        request.timings.embedding_wait_s += now - since
        request.timings.embedding_wait_since = None


def start_wait_if_blocked(request: Request, now: float, is_ready: Callable[[str], bool]) -> None:
    """Starts ``request``'s image wait when the next image it needs is not here, before any step finds
    it blocked: for a loop that holds its steps for that image, so that no step does meanwhile."""
    if request.is_decoding or request.timings.embedding_wait_since is not None or not request.mm_spans:
        return
    if computable(request, request.num_computed_tokens, request.num_tokens, is_ready)[1] is not None:
        request.timings.embedding_wait_since = now


def end_wait_if_computable(request: Request, now: float, is_ready: Callable[[str], bool]) -> None:
    """Ends ``request``'s image wait when its next token can be computed (the image it waited for is ready)."""
    if (
        request.timings.embedding_wait_since is not None
        and computable(request, request.num_computed_tokens, 1, is_ready)[0]
    ):
        end_embedding_wait(request, now)


def computable(request: Request, start: int, budget: int, is_ready: Callable[[str], bool]) -> tuple[int, str | None]:
    """Tokens of ``request`` computable from ``start`` within ``budget``: up to the first image
    whose embedding is not ready (``is_ready``); with that image's mm_hash, if one cut it short."""
    end = min(request.num_tokens, start + budget)
    for span in request.mm_spans:
        if span.end <= start:
            continue
        if span.offset >= end:
            break
        if not is_ready(span.mm_hash):
            return max(span.offset, start) - start, span.mm_hash
    return end - start, None


def next_chunk(request: Request, num_new: int) -> ScheduledChunk:
    """The chunk computing ``request``'s next ``num_new`` tokens (sampling after the last known one)."""
    start = request.num_computed_tokens
    end = start + num_new
    sample = end == request.num_tokens
    return ScheduledChunk(
        request_id=request.request_id,
        token_ids=token_slice(request, start, end),
        start_pos=start,
        block_ids=list(request.block_ids),
        image_slices=image_slices(request.mm_spans, start, end),
        sample=sample,
        sampling=request.sampling,
        num_output_tokens=len(request.output_token_ids),
        masked_token_ids=request.masked_token_ids,
        history=request.penalty_history if sample else None,
        rope=rope_plan(request),
        grammar=request.grammar if sample else None,
    )

"""How a request's tokens and image spans map onto chunks.

Pure Python helpers of the scheduler: which token ids and image rows a chunk
covers, and how long a request waited for its images. Nothing here decides
what to schedule.
"""

from __future__ import annotations

from services.pd.engine.outputs import ImageSlice
from services.pd.engine.request import MultiModalSpan, Request, RequestStatus


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
    """The parts of image spans inside positions ``[start, end)``, chunk-local."""
    slices = []
    for span in spans:
        lo, hi = max(start, span.offset), min(end, span.end)
        if lo < hi:
            slices.append(ImageSlice(span.mm_hash, src_start=lo - span.offset, dst_start=lo - start, length=hi - lo))
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

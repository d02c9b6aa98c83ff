"""A request body from the wire to a checked request object, before any work is spent on it.

The body is read within its time limits; its messages are counted in the raw
bytes (``check_message_count``); it is parsed, its fields checked (each one
honoured or refused, ``openai/fields.py``) and its sampling checked against the
model. A body over ``PARSE_INLINE_BYTES`` goes through all of that on the
text pool, so that the Python work of one large legal body does not hold up
every stream's next token on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from starlette.requests import Request

from services.common.video_files import DecodeBudget, DecodeStopped
from services.proxy.errors import ApiError, InvalidVideoUrlError, deadline_during_body, from_grpc
from services.proxy.openai.fields import IGNORED_FIELDS_HEADER, check_fields, ignored_fields_header
from services.proxy.openai.sampling import check_logit_bias, check_stop_token_ids, check_supported
from services.proxy.openai.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from services.proxy.prompt.media import image_sources
from services.proxy.prompt.preprocess import image_urls
from services.proxy.prompt.videos import ProcessedVideo, VideoRef, check_videos, sampling_options, video_refs
from services.proxy.web.http_util import check_message_count, parse_body, read_body

if TYPE_CHECKING:
    from services.proxy.state import ProxyState

log = logging.getLogger(__name__)

T = TypeVar("T")
PARSE_INLINE_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop (microseconds); larger ones on the text pool."""


async def read_request_body(request: Request, state: ProxyState, deadline: float) -> bytes:
    """The body, within ``--body-timeout-s`` (408 otherwise) and the request's ``deadline`` (504, as for
    any deadline; ``time.monotonic()``); either way the connection is closed after the answer."""
    left_s = deadline - time.monotonic()
    bound_s = state.config.body_timeout_s
    try:
        return await read_body(request, state.config.max_body_bytes, min(bound_s, left_s))
    except ApiError as error:
        if error.status_code == 408 and left_s < bound_s:
            raise deadline_during_body() from None
        raise


async def off_loop_if_large(state: ProxyState, raw: bytes, deadline: float, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: inline for a body up to ``PARSE_INLINE_BYTES``, else on the text pool (by ``deadline``)."""
    if len(raw) <= PARSE_INLINE_BYTES:
        return fn(*args)
    return await state.text_pool.run(fn, *args, deadline=deadline)


def read_chat(state: ProxyState, raw: bytes) -> tuple[ChatCompletionRequest, list[str], list[dict], list[str]]:
    """A chat body, parsed and checked before any work is spent: with its ignored fields, messages and image URLs."""
    check_message_count(raw, state.config.max_messages)
    body = parse_body(raw, ChatCompletionRequest)
    ignored = _check_fields(state, body, "/v1/chat/completions")
    _check_sampling(state, body)
    messages = body.messages_as_dicts()
    urls = image_urls(messages)
    state.preprocessor.check_image_count(len(urls))
    check_videos(state.preprocessor.adapter, len(video_refs(messages)), state.preprocessor.max_images)
    if body.mm_processor_kwargs is not None:  # checked even without a video: nothing is silently dropped
        sampling_options(body.mm_processor_kwargs, state.preprocessor.video_limits.max_frames, 1)
    return body, ignored, messages, urls


async def chat_videos(
    state: ProxyState, body: ChatCompletionRequest, refs: list[VideoRef], cache_salt: str, deadline: float
) -> tuple[ProcessedVideo, ...]:
    """The video stage of a chat request: sampling options checked, remote URLs fetched (as images are),
    then headers, frames and hashes on the video pool. The decode stops at the deadline (504) or, when the
    request ends first (its client gone), at its next frame: it never outlives its request by more."""
    if not refs:
        return ()
    preprocessor = state.preprocessor
    temporal = int(getattr(preprocessor.processor.image_processor, "temporal_patch_size", 1))
    sampling = sampling_options(body.mm_processor_kwargs, preprocessor.video_limits.max_frames, temporal)
    flat = [url for ref in refs for url in ([ref] if isinstance(ref, str) else ref)]
    if state.fetcher is None and any(not url.startswith("data:") for url in flat):
        raise InvalidVideoUrlError("Only data: URLs are accepted (remote URLs are disabled).", "video_url")
    fetched = await image_sources(flat, state.fetcher, deadline - time.monotonic())
    sources: list[str | bytes | list[str | bytes]] = []
    for ref in refs:  # back into one source per video: a URL's bytes, or a frame list
        taken = 1 if isinstance(ref, str) else len(ref)
        sources.append(fetched[0] if isinstance(ref, str) else fetched[:taken])
        fetched = fetched[taken:]
    budget = DecodeBudget(deadline)
    try:
        return await state.video_pool.run(
            preprocessor.chat_videos, sources, sampling, cache_salt, budget, deadline=deadline
        )
    except DecodeStopped:
        raise from_grpc(grpc.StatusCode.DEADLINE_EXCEEDED) from None
    finally:
        budget.cancel()


def read_completion(state: ProxyState, raw: bytes) -> tuple[CompletionRequest, list[str]]:
    """A completions body, parsed and checked before any work is spent, with its ignored fields."""
    body = parse_body(raw, CompletionRequest)
    ignored = _check_fields(state, body, "/v1/completions")
    _check_sampling(state, body)
    return body, ignored


def _check_sampling(state: ProxyState, body: _SamplingFields) -> None:
    state.check_model(body.model)
    check_supported(body, state.config.max_n)
    check_stop_token_ids(body.stop_token_ids, len(state.preprocessor.tokenizer))
    check_logit_bias(body.logit_bias, len(state.preprocessor.tokenizer))


def _check_fields(state: ProxyState, body: _SamplingFields, path: str) -> list[str]:
    """Refuses undeclared fields (``openai/fields.py``); logs the ignored ones' names in one line (bounded)."""
    ignored = check_fields(body, ignore_unknown=state.config.ignore_unknown_fields)
    if ignored:
        log.info("%s: ignored unknown fields %s", path, ignored_fields_header(ignored)[IGNORED_FIELDS_HEADER])
    return ignored

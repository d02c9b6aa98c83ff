"""PD messages -> OpenAI responses: the SSE stream and the whole (collected) response.

The two formatters (chat and text completions, ``services.proxy.openai.formatters``)
share the one streaming and the one collecting routine here. A request with
``n`` choices has one PD stream per choice, merged as messages arrive. A stream that fails after its first
event ends with an OpenAI error event and ``[DONE]``, never with a normal
``finish_reason``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, NamedTuple

from services.common.pb import epd_pb2
from services.proxy.errors import ApiError, internal_error
from services.proxy.openai.formatters import ChatFormatter, ResponseMeta
from services.proxy.trace import Trace

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"

FINISH_REASONS = {
    epd_pb2.FINISH_REASON_STOP: "stop",
    epd_pb2.FINISH_REASON_LENGTH: "length",
}
"""The one table from PD finish reasons to OpenAI strings."""


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def usage_dict(usage: epd_pb2.Usage, trace: Trace, num_images: int, num_video_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage plus ``prompt_tokens_details.cached_tokens`` and the ``epd`` extension. PD counts every
    embedding token as an image token; ``num_video_tokens`` of them were videos' (the proxy's count)."""
    timings = {
        "preprocess": _ms(trace.preprocess_ms),
        "window": _ms(trace.window_ms),
        "preallocate": _ms(trace.preallocate_ms),
        "encode": _ms(trace.encode_ms),
        "queue": _ms(usage.timings.queue_ms),
        "embedding_wait": _ms(usage.timings.embedding_wait_ms),
        "prefill": _ms(usage.timings.prefill_ms),
        "decode": _ms(usage.timings.decode_ms),
        "first_token": _ms(trace.first_token_ms),
        "total": _ms((time.monotonic() - trace.started) * 1000),
    }
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "epd": {
            "image_tokens": max(0, usage.image_tokens - num_video_tokens),
            "video_tokens": num_video_tokens,
            "num_images": num_images,
            "num_images_ready": trace.num_images_ready,
            "num_encoder_cache_hits": trace.num_encoder_cache_hits,
            "num_pd_attempts": trace.num_pd_attempts,
            "timings_ms": {k: v for k, v in timings.items() if v is not None},
        },
    }


class Choice(NamedTuple):
    """One choice's PD messages (``Pipeline.generate``) and its proxy-side trace."""

    messages: AsyncGenerator[epd_pb2.GenerateResponse, None]
    trace: Trace


def _finish_reason(message: epd_pb2.GenerateResponse) -> str:
    try:
        return FINISH_REASONS[message.finish_reason]
    except KeyError:
        raise internal_error("The model server sent an unknown finish reason.") from None


def combined_usage(
    finals: Sequence[epd_pb2.GenerateResponse], traces: Sequence[Trace], meta: ResponseMeta
) -> dict[str, Any]:
    """Usage of a whole response: the prompt counted once, completions summed over the choices."""
    usage = usage_dict(finals[0].usage, traces[0], meta.num_images, meta.num_video_tokens)
    if len(finals) > 1:
        usage["completion_tokens"] = sum(f.usage.completion_tokens for f in finals)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        usage["epd"]["num_choices"] = len(finals)
        usage["epd"]["num_pd_attempts"] = sum(t.num_pd_attempts for t in traces)
    return _without_cache_details(usage) if meta.hide_cache_details else usage


CACHE_DETAILS = ("num_images_ready", "num_encoder_cache_hits", "num_pd_attempts", "timings_ms")
"""``usage.epd`` entries that tell a client whether someone else sent the same image or prompt."""


def _without_cache_details(usage: dict[str, Any]) -> dict[str, Any]:
    """``--hide-cache-details``: usage without what the caches did (cached tokens, image hits, stage timings)."""
    usage.pop("prompt_tokens_details", None)
    usage["epd"] = {k: v for k, v in usage["epd"].items() if k not in CACHE_DETAILS}
    return usage


async def _next_or_none(messages: AsyncGenerator[epd_pb2.GenerateResponse, None]) -> epd_pb2.GenerateResponse | None:
    try:
        return await anext(messages)
    except StopAsyncIteration:  # cannot travel through a Future as itself
        return None


async def merge(choices: Sequence[Choice]) -> AsyncGenerator[tuple[int, epd_pb2.GenerateResponse], None]:
    """``(choice index, message)`` from every choice, in arrival order.

    The first failure of any choice ends the merge; leaving it (error,
    consumer gone) cancels and closes every choice, which releases their
    PD and encoder work.
    """
    if len(choices) == 1:
        async with contextlib.aclosing(choices[0].messages) as messages:
            async for message in messages:
                yield 0, message
        return
    pending: dict[asyncio.Task, int] = {}
    try:
        for index, choice in enumerate(choices):
            pending[asyncio.create_task(_next_or_none(choice.messages))] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                message = task.result()
                if message is not None:
                    pending[asyncio.create_task(_next_or_none(choices[index].messages))] = index
                    yield index, message
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for choice in choices:
            with contextlib.suppress(Exception):
                await choice.messages.aclose()


async def _events(
    choices: Sequence[Choice], formatter: ChatFormatter, include_usage: bool, want_logprobs: bool
) -> AsyncGenerator[bytes, None]:
    started = [False] * len(choices)
    finals: list[epd_pb2.GenerateResponse | None] = [None] * len(choices)
    async with contextlib.aclosing(merge(choices)) as messages:
        async for index, message in messages:
            if not started[index]:
                started[index] = True
                role = formatter.role_chunk(index, include_usage)
                if role is not None:
                    yield sse_event(role)
            ids_wanted = formatter.meta.return_token_ids and message.token_ids
            if message.text or (want_logprobs and message.logprobs) or ids_wanted:
                logprobs = list(message.logprobs) if want_logprobs else None
                yield sse_event(
                    formatter.delta_chunk(index, message.text, logprobs, include_usage, list(message.token_ids))
                )
            if message.finish_reason != epd_pb2.FINISH_REASON_UNSPECIFIED:
                yield sse_event(formatter.finish_chunk(index, _finish_reason(message), include_usage))
                finals[index] = message
    done = [final for final in finals if final is not None]
    if len(done) < len(finals):
        raise internal_error("The model server ended the stream without a result.")
    if include_usage:
        traces = [c.trace for c in choices]
        yield sse_event(formatter.usage_chunk(combined_usage(done, traces, formatter.meta)))
    yield SSE_DONE


async def stream_events(
    choices: Sequence[Choice],
    formatter: ChatFormatter,
    *,
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncGenerator[bytes, None]:
    """PD messages -> SSE bytes, ending with ``[DONE]``.

    Errors before the first event propagate (the caller can still answer
    with an HTTP status); after it they become an error event + ``[DONE]``.
    """
    started = False
    try:
        async with contextlib.aclosing(_events(choices, formatter, include_usage, want_logprobs)) as events:
            async for event in events:
                started = True
                yield event
    except Exception as error:
        if not started:
            raise
        if not isinstance(error, ApiError):
            log.exception("request %s: stream failed", formatter.meta.response_id)
            error = internal_error()
        yield sse_event(error.body())
        yield SSE_DONE


async def collect(choices: Sequence[Choice], formatter: ChatFormatter, *, want_logprobs: bool) -> dict[str, Any]:
    """Consumes every choice into one non-streaming response object."""
    n = len(choices)
    texts: list[list[str]] = [[] for _ in range(n)]
    token_ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[epd_pb2.TokenLogprob]] = [[] for _ in range(n)]
    finals: list[epd_pb2.GenerateResponse | None] = [None] * n
    async with contextlib.aclosing(merge(choices)) as messages:
        async for index, message in messages:
            texts[index].append(message.text)
            token_ids[index].extend(message.token_ids)
            logprobs[index].extend(message.logprobs)
            if message.finish_reason != epd_pb2.FINISH_REASON_UNSPECIFIED:
                finals[index] = message
    done = [final for final in finals if final is not None]
    if len(done) < n:
        raise internal_error("The model server ended the stream without a result.")
    entries = [
        formatter.choice(
            i, "".join(texts[i]), logprobs[i] if want_logprobs else None, _finish_reason(done[i]), token_ids[i]
        )
        for i in range(n)
    ]
    return formatter.full(entries, combined_usage(done, [c.trace for c in choices], formatter.meta))

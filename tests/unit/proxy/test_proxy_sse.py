"""SSE formatting: chunks, finish, usage, and errors before/after the first event."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from services.common.pb import epd_pb2
from services.proxy.errors import ApiError, from_grpc
from services.proxy.openai.formatters import ChatFormatter, CompletionFormatter, ResponseMeta
from services.proxy.openai.responses import (
    SSE_DONE,
    Choice,
    collect,
    sse_event,
    stream_events,
)
from services.proxy.trace import Trace


def meta() -> ResponseMeta:
    return ResponseMeta("chatcmpl-x", "tiny", decode_token=lambda t: f"<{t}>", num_images=1)


def final(text: str = "", reason=epd_pb2.FINISH_REASON_STOP) -> epd_pb2.GenerateResponse:
    usage = epd_pb2.Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=4, image_tokens=3)
    usage.timings.prefill_ms = 1.5
    return epd_pb2.GenerateResponse(token_ids=[2], text=text, finish_reason=reason, usage=usage)


async def messages(*items):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def parse(events: list[bytes]) -> list:
    out = []
    for event in events:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        body = event[len(b"data: ") : -2]
        out.append("[DONE]" if body == b"[DONE]" else json.loads(body))
    return out


def one(source) -> list[Choice]:
    return [Choice(source, Trace())]


async def run_stream(source, formatter=None, include_usage=False, want_logprobs=False) -> list:
    formatter = formatter or ChatFormatter(meta())
    return parse(
        [
            e
            async for e in stream_events(
                one(source), formatter, include_usage=include_usage, want_logprobs=want_logprobs
            )
        ]
    )


def test_sse_event_format():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


async def test_chat_stream_role_deltas_finish_done():
    events = await run_stream(messages(epd_pb2.GenerateResponse(token_ids=[1], text="Hel"), final("lo")))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["Hel", "lo"]
    assert events[3]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert {e["id"] for e in events[:-1]} == {"chatcmpl-x"}
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}


async def test_include_usage_adds_usage_chunk():
    events = await run_stream(messages(final("x", epd_pb2.FINISH_REASON_LENGTH)), include_usage=True)
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-3]["usage"] is None
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["prompt_tokens"] == 10 and usage["completion_tokens"] == 2 and usage["total_tokens"] == 12
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
    assert usage["epd"]["image_tokens"] == 3 and usage["epd"]["num_images"] == 1
    assert usage["epd"]["timings_ms"]["prefill"] == 1.5


async def test_error_before_first_event_propagates():
    with pytest.raises(ApiError) as caught:
        await run_stream(messages(from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, 2000)))
    assert caught.value.status_code == 503


async def test_error_after_first_event_becomes_error_event_and_done():
    events = await run_stream(
        messages(epd_pb2.GenerateResponse(token_ids=[1], text="a"), from_grpc(grpc.StatusCode.INTERNAL))
    )
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "internal_error"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])


async def test_stream_ending_without_finish_is_an_error_not_a_stop():
    events = await run_stream(messages(epd_pb2.GenerateResponse(token_ids=[1], text="a")))
    assert "error" in events[-2] and events[-1] == "[DONE]"


async def test_unexpected_exception_mid_stream_is_a_generic_500_event():
    events = await run_stream(messages(epd_pb2.GenerateResponse(text="a"), RuntimeError("secret prompt text")))
    assert events[-2]["error"]["type"] == "server_error"
    assert "secret" not in json.dumps(events)


async def test_chat_logprobs_format():
    entry = epd_pb2.TokenLogprob(token_id=5, logprob=-0.5, top_token_ids=[5, 6], top_logprobs=[-0.5, -1.0])
    events = await run_stream(
        messages(epd_pb2.GenerateResponse(token_ids=[5], text="<5>", logprobs=[entry]), final()), want_logprobs=True
    )
    content = events[1]["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "<5>" and content[0]["logprob"] == -0.5
    assert content[0]["bytes"] == list(b"<5>")
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<5>", "<6>"]


async def test_completion_stream_and_collect():
    formatter = CompletionFormatter(meta())
    events = await run_stream(messages(epd_pb2.GenerateResponse(text="ab"), final("c")), formatter=formatter)
    assert events[0]["object"] == "text_completion"
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["ab", "c", ""]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"

    whole = await collect(
        one(messages(epd_pb2.GenerateResponse(text="ab"), final("c"))), formatter, want_logprobs=False
    )
    assert whole["choices"][0]["text"] == "abc"
    assert whole["usage"]["total_tokens"] == 12


async def test_completion_logprobs_format():
    entry = epd_pb2.TokenLogprob(token_id=5, logprob=-0.5, top_token_ids=[6], top_logprobs=[-1.0])
    whole = await collect(
        one(messages(epd_pb2.GenerateResponse(text="<5>", logprobs=[entry, entry]), final())),
        CompletionFormatter(meta()),
        want_logprobs=True,
    )
    logprobs = whole["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<5>", "<5>"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["top_logprobs"] == [{"<6>": -1.0}, {"<6>": -1.0}]
    assert logprobs["text_offset"] == [0, 3]


async def test_chat_collect():
    whole = await collect(
        one(messages(epd_pb2.GenerateResponse(text="a"), final("b"))), ChatFormatter(meta()), want_logprobs=False
    )
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["choices"][0]["logprobs"] is None


# --------------------------------------------------------------------------- n > 1


async def slow_messages(delay: float, *items):
    for item in items:
        await asyncio.sleep(delay)
        if isinstance(item, Exception):
            raise item
        yield item


async def test_two_choices_stream_interleaved_with_indexes_and_one_usage():
    choices = [
        Choice(slow_messages(0.01, epd_pb2.GenerateResponse(text="a1"), final("a2")), Trace()),
        Choice(slow_messages(0.015, epd_pb2.GenerateResponse(text="b1"), final("b2")), Trace()),
    ]
    events = parse(
        [e async for e in stream_events(choices, ChatFormatter(meta()), include_usage=True, want_logprobs=False)]
    )
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["prompt_tokens"] == 10 and usage["completion_tokens"] == 4 and usage["total_tokens"] == 14
    assert usage["epd"]["num_choices"] == 2
    by_index: dict[int, str] = {0: "", 1: ""}
    roles, finishes = [], []
    for event in events[:-2]:
        choice = event["choices"][0]
        by_index[choice["index"]] += choice["delta"].get("content", "")
        if choice["delta"].get("role"):
            roles.append(choice["index"])
        if choice["finish_reason"]:
            finishes.append(choice["index"])
    assert by_index == {0: "a1a2", 1: "b1b2"}
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]


async def test_two_choices_collect_in_index_order():
    choices = [
        Choice(slow_messages(0.02, final("slow")), Trace()),
        Choice(slow_messages(0.0, final("fast", epd_pb2.FINISH_REASON_LENGTH)), Trace()),
    ]
    whole = await collect(choices, CompletionFormatter(meta()), want_logprobs=False)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "slow", "stop"),
        (1, "fast", "length"),
    ]
    assert whole["usage"]["completion_tokens"] == 4


async def test_one_failing_choice_fails_the_request_and_closes_the_others():
    closed = []

    async def endless():
        try:
            while True:
                await asyncio.sleep(0.01)
                yield epd_pb2.GenerateResponse(text="x")
        finally:
            closed.append(True)

    choices = [Choice(endless(), Trace()), Choice(slow_messages(0.03, from_grpc(grpc.StatusCode.UNAVAILABLE)), Trace())]
    with pytest.raises(ApiError) as caught:
        await collect(choices, ChatFormatter(meta()), want_logprobs=False)
    assert caught.value.status_code == 503
    assert closed == [True]

"""``epd bench serve`` client: SSE timestamps, token counts, failure reasons, open-loop schedule, balancing."""

from __future__ import annotations

import asyncio
import json

from services.bench.serve.client import Targets, run_schedule
from services.bench.serve.workload import RequestSpec


def sse(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def chunk(token_ids) -> bytes:
    return sse({"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": token_ids}]})


class FakeSseProxy:
    """A minimal HTTP/1.1 server that answers each POST as its body's ``case`` says."""

    def __init__(self, hold_until: int = 0) -> None:
        self.server: asyncio.AbstractServer | None = None
        self.hold_until = hold_until  # answer nothing until this many requests have arrived
        self.num_arrived = 0
        self.all_arrived = asyncio.Event()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        self.num_arrived += 1
        if self.num_arrived >= self.hold_until:
            self.all_arrived.set()
        await asyncio.wait_for(self.all_arrived.wait(), timeout=10)
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        case = json.loads(await reader.readexactly(length))["case"]
        if case == "http500":
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            writer.write(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
            for ids in ([11], [12, 13]):
                await writer.drain()
                await asyncio.sleep(0.03)
                writer.write(chunk(ids))
            if case == "error_event":
                writer.write(sse({"error": {"message": "x", "type": "server_error", "code": "overloaded"}}))
            if case in ("ok", "error_event"):
                writer.write(sse({"choices": [], "usage": {"prompt_tokens": 21, "completion_tokens": 3}}))
            if case == "epd_usage":
                timings = {"preallocate": 4.5, "encode": 120, "first_token": 300.25, "odd": "x", "flag": True}
                usage = {"prompt_tokens": 21, "completion_tokens": 3, "epd": {"timings_ms": timings}}
                writer.write(sse({"choices": [], "usage": usage}))
            if case in ("ok", "error_event", "epd_usage"):
                writer.write(sse(b"[DONE]"))
        await writer.drain()
        writer.close()


def spec(index: int) -> RequestSpec:
    return RequestSpec(index=index, prompt="p", images=(), image_class=None, max_tokens=3)


async def test_tokens_are_timestamped_per_chunk_and_counted_from_token_ids():
    async with FakeSseProxy() as url:
        [record] = await run_schedule([url], [spec(0)], [json.dumps({"case": "ok"}).encode()], [0.0])
    assert record.ok, record.error
    assert record.num_tokens == 3 and record.prompt_tokens == 21
    first, second, third = record.token_times_s
    assert first < second == third  # the last two came in one chunk: one arrival time
    assert record.end_s >= third and record.target == url


async def test_stage_timings_are_kept_when_the_server_reports_them():
    async with FakeSseProxy() as url:
        plain, epd = await run_schedule(
            [url], [spec(0), spec(1)], [json.dumps({"case": c}).encode() for c in ("ok", "epd_usage")], [0.0, 0.0]
        )
    assert plain.ok and plain.stages_ms == {}  # a server without the extension (vLLM)
    assert epd.ok and epd.stages_ms == {"preallocate": 4.5, "encode": 120.0, "first_token": 300.25}
    assert epd.to_json()["stages_ms"] == epd.stages_ms


async def test_failures_get_short_reasons_without_content():
    cases = ["http500", "error_event", "no_done"]
    async with FakeSseProxy() as url:
        records = await run_schedule(
            [url], [spec(i) for i in range(3)], [json.dumps({"case": c}).encode() for c in cases], [0.0, 0.0, 0.0]
        )
    assert [r.error for r in records] == ["HTTP 500", "stream error: overloaded", "stream ended without [DONE]"]
    assert not any(r.ok for r in records)


async def test_unreachable_proxy_is_a_failed_request_not_a_crash():
    [record] = await run_schedule(["http://127.0.0.1:1"], [spec(0)], [b"{}"], [0.0], request_timeout_s=5)
    assert record.error == "ConnectError" and not record.ok


async def test_requests_leave_on_schedule_without_waiting_for_earlier_ones():
    # The fake answers nothing until all three requests are in: a client that
    # waited for one response before sending the next would never finish.
    async with FakeSseProxy(hold_until=3) as url:
        records = await run_schedule(
            [url], [spec(i) for i in range(3)], [json.dumps({"case": "ok"}).encode()] * 3, [0.0, 0.01, 0.02]
        )
    assert all(r.ok for r in records), [r.error for r in records]
    assert [round(r.scheduled_s, 2) for r in records] == [0.0, 0.01, 0.02]
    assert [r.index for r in records] == [0, 1, 2]


def test_targets_pick_the_proxy_with_fewest_requests_in_flight():
    targets = Targets(["a", "b"])
    first, second = targets.acquire(), targets.acquire()
    assert {first, second} == {"a", "b"}
    targets.release("b")
    assert targets.acquire() == "b"
    targets.release("a")
    targets.release("b")
    picks = []
    for _ in range(4):
        picks.append(targets.acquire())
        targets.release(picks[-1])
    assert set(picks) == {"a", "b"}  # idle proxies take turns

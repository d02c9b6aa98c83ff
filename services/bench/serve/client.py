"""Open-loop streaming client of ``epd bench serve``: sends on schedule, timestamps every token.

Requests are sent at their arrival times whether or not earlier ones have
finished (open loop: a slow server faces a growing queue, as it would in
production). Each request streams SSE from ``/v1/chat/completions``; the
proxy's ``return_token_ids`` extension says how many tokens each chunk
carries, so token counts are exact.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence

import httpx

from services.bench.serve.stats import RequestRecord
from services.bench.serve.workload import RequestSpec

CHAT_PATH = "/v1/chat/completions"
MAX_ERROR_CHARS = 80


class Targets:
    """Proxy URLs; each request goes to the one with the fewest requests in flight (rotation breaks ties)."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("need at least one proxy URL")
        self.urls = list(urls)
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._turn = itertools.count()

    def acquire(self) -> str:
        start = next(self._turn) % len(self.urls)
        rotated = self.urls[start:] + self.urls[:start]
        url = min(rotated, key=self._in_flight.__getitem__)
        self._in_flight[url] += 1
        return url

    def release(self, url: str) -> None:
        self._in_flight[url] -= 1


def _error_of(payload: dict) -> str:
    """A short, content-free reason from an OpenAI error event."""
    error = payload.get("error") or {}
    reason = error.get("code") or error.get("type") or "error"
    return f"stream error: {str(reason)[:MAX_ERROR_CHARS]}"


def _stages_of(usage: dict) -> dict[str, float]:
    """The stage timings an ``epd`` proxy reports in ``usage.epd.timings_ms`` (numbers only; {} elsewhere)."""
    extension = usage.get("epd")
    timings = extension.get("timings_ms") if isinstance(extension, dict) else None
    if not isinstance(timings, dict):
        return {}
    return {str(k): float(v) for k, v in timings.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


async def send_one(
    client: httpx.AsyncClient,
    targets: Targets,
    body: bytes,
    record: RequestRecord,
    run_start: float,
    on_chunk: Callable[[dict], None] | None = None,
) -> RequestRecord:
    """Sends one request and fills ``record`` as its stream arrives; never raises for request failures.

    ``on_chunk`` sees every parsed chunk (``epd bench multiturn`` keeps the answer's text and the usage)."""
    url = targets.acquire()
    record.target = url
    sent = time.perf_counter()
    record.start_s = sent - run_start
    try:
        async with client.stream(
            "POST", url + CHAT_PATH, content=body, headers={"content-type": "application/json"}
        ) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                now = time.perf_counter() - sent
                if data == "[DONE]":
                    record.end_s = now
                    break
                payload = json.loads(data)
                if "error" in payload:
                    record.error = _error_of(payload)
                    break
                if on_chunk is not None:
                    on_chunk(payload)
                for choice in payload.get("choices") or ():
                    # Tokens of one chunk arrived together: they share its time.
                    record.token_times_s.extend([now] * len(choice.get("token_ids") or ()))
                usage = payload.get("usage")
                if usage:
                    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    record.stages_ms = _stages_of(usage)
            if record.error is None and record.end_s is None:
                record.error = "stream ended without [DONE]"
    except (httpx.HTTPError, OSError, ValueError) as error:
        record.error = type(error).__name__
    finally:
        targets.release(url)
    if record.error is None and not record.token_times_s:
        record.error = "no tokens"
    return record


async def run_schedule(
    urls: Sequence[str],
    specs: Sequence[RequestSpec],
    bodies: Sequence[bytes],
    arrivals: Sequence[float],
    *,
    request_timeout_s: float = 600.0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Sends ``specs`` at ``arrivals`` (seconds from now) and returns their records in spec order."""
    targets = Targets(urls)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(specs) or 1)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    records = [
        RequestRecord(
            index=s.index, kind=s.kind, num_images=len(s.images), image_class=s.image_class, scheduled_s=arrival
        )
        for s, arrival in zip(specs, arrivals)
    ]

    async def one(i: int) -> None:
        await send_one(client, targets, bodies[i], records[i], run_start)
        if on_done is not None:
            on_done(records[i])

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        run_start = time.perf_counter()
        tasks = []
        for i, arrival in enumerate(arrivals):
            delay = run_start + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return records


async def run_sequential(
    urls: Sequence[str], specs: Sequence[RequestSpec], bodies: Sequence[bytes], *, request_timeout_s: float = 600.0
) -> list[RequestRecord]:
    """One request at a time (warm-up and single-request calibration)."""
    records = []
    for spec, body in zip(specs, bodies):
        records += await run_schedule(urls, [spec], [body], [0.0], request_timeout_s=request_timeout_s)
    return records

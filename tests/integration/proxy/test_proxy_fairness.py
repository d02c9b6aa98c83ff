"""Per-client limits at the proxy (issue 27, "no per-client fairness"): requests in flight and a token bucket.

One client could fill the shared FIFO queues with n ≤ 8 × max_tokens ≤ 16,384 requests. With
``--max-requests-per-client`` / ``--max-tokens-per-client-per-minute`` its excess gets a 429
while other clients are served; every exit path gives the allowance back (the fixture checks
that nothing stays counted after each test).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import httpx
from proxy_doubles import Failure, wait_until

TEXT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


def _client_at(cluster, host: str, **headers: str) -> httpx.AsyncClient:
    """Another client of the in-process proxy, seen at address ``host``."""
    transport = httpx.ASGITransport(app=cluster.app, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=10, headers=headers)


def _limiter(cluster):
    return cluster.app.state.proxy.limiter


def _refusals(cluster, reason: str) -> float:
    value = cluster.app.state.proxy.metrics.registry.get_sample_value(
        "epd_proxy_client_limit_refusals_total", {"reason": reason}
    )
    return value or 0.0


def _assert_rate_limited(reply: httpx.Response) -> int:
    assert reply.status_code == 429, reply.text
    error = reply.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
    return int(reply.headers["Retry-After"])


async def test_limits_are_off_by_default_many_concurrent_requests_from_one_client_are_served(cluster_factory):
    cluster = await cluster_factory()
    cluster.pd.hold_first_token.clear()
    tasks = [asyncio.create_task(cluster.client.post("/v1/chat/completions", json={**TEXT, "n": 4})) for _ in range(6)]
    await wait_until(lambda: cluster.pd.num_active == 24)
    cluster.pd.hold_first_token.set()
    replies = await asyncio.gather(*tasks)
    assert [r.status_code for r in replies] == [200] * 6
    assert _refusals(cluster, "requests") == 0 and _refusals(cluster, "tokens") == 0


async def test_the_next_concurrent_request_from_a_client_over_its_limit_is_429_while_another_client_is_served(
    cluster_factory,
):
    cluster = await cluster_factory(max_requests_per_client=2)
    cluster.pd.hold_first_token.clear()
    held = [asyncio.create_task(cluster.client.post("/v1/chat/completions", json=TEXT)) for _ in range(2)]
    await wait_until(lambda: cluster.pd.num_active == 2)
    over = await cluster.client.post("/v1/chat/completions", json=TEXT)
    assert _assert_rate_limited(over) >= 1
    two_choices = await cluster.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2})
    _assert_rate_limited(two_choices)
    async with _client_at(cluster, "10.0.0.2") as other:
        served = asyncio.create_task(other.post("/v1/chat/completions", json=TEXT))
        await wait_until(lambda: cluster.pd.num_active == 3)  # admitted beside the full client
        cluster.pd.hold_first_token.set()
        assert (await served).status_code == 200
    assert [(await task).status_code for task in held] == [200, 200]
    assert _refusals(cluster, "requests") == 2
    assert (await cluster.client.post("/v1/chat/completions", json={**TEXT, "n": 2})).status_code == 200
    assert _limiter(cluster).num_in_flight == {}


async def test_a_slot_is_freed_after_success_and_after_an_error(cluster_factory):
    cluster = await cluster_factory(max_requests_per_client=1)
    for _ in range(3):
        assert (await cluster.client.post("/v1/chat/completions", json=TEXT)).status_code == 200
    cluster.pd.generate_failure = Failure(grpc.StatusCode.INVALID_ARGUMENT)
    for stream in (False, True):
        reply = await cluster.client.post("/v1/chat/completions", json={**TEXT, "stream": stream})
        assert reply.status_code == 400, reply.text
    cluster.pd.generate_failure = None
    cluster.pd.fail_after_first = Failure(grpc.StatusCode.INTERNAL)  # after the 200: an error event in the stream
    reply = await cluster.client.post("/v1/chat/completions", json={**TEXT, "stream": True})
    assert reply.status_code == 200 and '"error"' in reply.text
    cluster.pd.fail_after_first = None
    assert (await cluster.client.post("/v1/chat/completions", json={**TEXT, "stream": True})).status_code == 200
    assert _limiter(cluster).num_in_flight == {}


async def test_a_slot_is_freed_when_the_client_disconnects_from_its_stream(cluster_factory):
    cluster = await cluster_factory(http=True, max_requests_per_client=1)
    cluster.pd.hold_after_first.clear()  # the stream stays open after its first token
    async with (
        httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client,
        client.stream("POST", "/v1/chat/completions", json={**TEXT, "stream": True}) as reply,
    ):
        assert reply.status_code == 200
        chunks = reply.aiter_raw()  # kept referenced: a finalized iterator would close the stream early
        assert await anext(chunks)
        _assert_rate_limited(await cluster.client.post("/v1/chat/completions", json=TEXT))
    await wait_until(lambda: _limiter(cluster).num_in_flight == {})
    cluster.pd.hold_after_first.set()
    assert (await cluster.client.post("/v1/chat/completions", json=TEXT)).status_code == 200


async def test_a_slot_is_freed_when_a_waiting_non_streaming_client_goes_away(cluster_factory):
    cluster = await cluster_factory(http=True, max_requests_per_client=1)
    cluster.pd.hold_first_token.clear()
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        waiting = asyncio.create_task(client.post("/v1/chat/completions", json=TEXT))
        await wait_until(lambda: cluster.pd.num_active == 1)
        _assert_rate_limited(await cluster.client.post("/v1/chat/completions", json=TEXT))
        waiting.cancel()  # the client hangs up before any answer
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    await wait_until(lambda: _limiter(cluster).num_in_flight == {})
    cluster.pd.hold_first_token.set()
    assert (await cluster.client.post("/v1/chat/completions", json=TEXT)).status_code == 200


async def test_the_token_bucket_refuses_with_a_retry_after_and_refunds_unused_completion_tokens(cluster_factory):
    cluster = await cluster_factory(max_tokens_per_client_per_minute=1000)
    # 600 asked, 3 used: the refund lets the next one in (without it 2 × 600 > 1000).
    for _ in range(3):
        assert (await cluster.client.post("/v1/chat/completions", json={**TEXT, "max_tokens": 600})).status_code == 200
    cluster.pd.hold_first_token.clear()
    held = asyncio.create_task(cluster.client.post("/v1/chat/completions", json={**TEXT, "max_tokens": 600}))
    await wait_until(lambda: cluster.pd.num_active == 1)
    over = await cluster.client.post("/v1/chat/completions", json={**TEXT, "max_tokens": 600})
    assert 12 <= _assert_rate_limited(over) <= 60  # the missing ~200 + 2 × prompt tokens at 1000 per minute
    too_big = await cluster.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 300, "n": 4})
    assert _assert_rate_limited(too_big) == 60 and "1000 per minute" in too_big.json()["error"]["message"]
    async with _client_at(cluster, "10.0.0.2") as other:  # its own bucket
        served = asyncio.create_task(other.post("/v1/chat/completions", json={**TEXT, "max_tokens": 600}))
        await wait_until(lambda: cluster.pd.num_active == 2)
        cluster.pd.hold_first_token.set()
        assert (await served).status_code == 200
    assert (await held).status_code == 200
    assert (await cluster.client.post("/v1/chat/completions", json={**TEXT, "max_tokens": 600})).status_code == 200
    assert _refusals(cluster, "tokens") == 2


async def test_behind_an_api_key_the_key_is_the_client_whatever_the_address_and_is_never_echoed(cluster_factory):
    key = "sk-fairness-secret"
    cluster = await cluster_factory(api_key=key, max_requests_per_client=1)
    cluster.pd.hold_first_token.clear()
    async with (
        _client_at(cluster, "10.0.0.2", authorization=f"Bearer {key}") as first,
        _client_at(cluster, "10.0.0.3", authorization=f"Bearer {key}") as second,
    ):
        held = asyncio.create_task(first.post("/v1/chat/completions", json=TEXT))
        await wait_until(lambda: cluster.pd.num_active == 1)
        over = await second.post("/v1/chat/completions", json=TEXT)
        _assert_rate_limited(over)
        assert key not in over.text and key not in str(over.headers)
        assert all(key not in client for client in _limiter(cluster).num_in_flight)
        cluster.pd.hold_first_token.set()
        assert (await held).status_code == 200
    assert key.encode() not in cluster.app.state.proxy.metrics.render()

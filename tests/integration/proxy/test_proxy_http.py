"""The proxy's HTTP surface: validation, limits, metadata endpoints, disconnects, the openai client."""

from __future__ import annotations

import asyncio
import base64
import io
import random

import grpc
import httpx
import openai
import pydantic
import pytest
from PIL import Image
from proxy_doubles import Failure, image_message, openai_client, png_data_url, wait_until

from services.proxy.prompt.media import MediaFetcher, MediaPolicy

SECRET = "zebra-secret-42"
TEXT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


async def post(cluster, body, path="/v1/chat/completions", **kwargs):
    return await cluster.client.post(path, json=body, **kwargs)


def assert_openai_error(reply, status: int, code: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    assert SECRET not in reply.text
    return error


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({**TEXT, "model": "gpt-4"}, "model_not_found", "model"),
        ({"max_tokens": 3}, "invalid_request", "messages"),
        ({"messages": []}, "invalid_request", "messages"),
        ({"messages": [{"role": "wizard", "content": SECRET}]}, "invalid_request", None),
        ({**TEXT, "n": 9}, "invalid_request", "n"),
        ({**TEXT, "n": 0}, "invalid_request", "n"),
        ({**TEXT, "logit_bias": {SECRET: "high"}}, "invalid_request", "logit_bias"),
        ({"messages": [{"role": "user", "content": [{"type": SECRET, "text": "x"}]}]}, "invalid_request", "messages"),
        ({**TEXT, "temperature": 9}, "invalid_request", "temperature"),
        ({**TEXT, "max_tokens": 4000}, "context_length_exceeded", "max_tokens"),
        ({**TEXT, "max_tokens": 10**6}, "invalid_request", "max_tokens"),
        ({"messages": [{"role": "user", "content": f"{SECRET} <image>"}]}, "invalid_image_placeholder", "messages"),
        ({"messages": [image_message("data:image/png;base64,@@" + SECRET)]}, "invalid_image_base64", "image_url"),
        ({"messages": [image_message("https://example.com/a.png")]}, "invalid_image_url", "image_url"),
        ({"messages": [image_message(*[png_data_url()] * 9)]}, "too_many_images", "messages"),
    ],
)
async def test_invalid_requests_are_openai_400s_without_backend_work(cluster_factory, body, code, param):
    cluster = await cluster_factory()
    status = 404 if code == "model_not_found" else 400
    error = assert_openai_error(await post(cluster, body), status, code)
    if param is not None:
        assert error["param"].startswith(param)
    assert cluster.pd.preallocates == [] and cluster.pd.generates == [] and cluster.encoder.encodes == []


async def test_malformed_json_is_400(cluster_factory):
    cluster = await cluster_factory()
    reply = await cluster.client.post(
        "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert_openai_error(reply, 400, "invalid_request")


async def test_truncated_image_is_400_before_any_backend_call(cluster_factory):
    cluster = await cluster_factory()
    noise = Image.frombytes("RGB", (64, 64), bytes(random.Random(0).randrange(256) for _ in range(64 * 64 * 3)))
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    raw = buffer.getvalue()
    truncated = "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()
    assert_openai_error(await post(cluster, {"messages": [image_message(truncated)]}), 400, "invalid_image_data")
    assert cluster.pd.preallocates == [] and cluster.encoder.encodes == []


async def test_body_limit_by_content_length_and_while_reading(cluster_factory):
    cluster = await cluster_factory(max_body_bytes=2048)
    big = {"messages": [{"role": "user", "content": "x" * 4096}]}
    assert_openai_error(await post(cluster, big), 413, "request_too_large")

    async def chunked():  # no Content-Length: the limit applies while reading
        for _ in range(10):
            yield b" " * 512

    reply = await cluster.client.post("/v1/chat/completions", content=chunked())
    assert_openai_error(reply, 413, "request_too_large")
    assert cluster.pd.generates == []


async def test_unknown_route_and_method_use_openai_errors(cluster_factory):
    cluster = await cluster_factory()
    assert_openai_error(await cluster.client.get("/v1/nothing"), 404)
    assert_openai_error(await cluster.client.get("/v1/chat/completions"), 405)


async def test_fastapi_validation_errors_become_400(cluster_factory):
    cluster = await cluster_factory()

    class Body(pydantic.BaseModel):
        value: int

    async def typed(body: Body) -> dict:
        return {"ok": body.value}

    cluster.app.add_api_route("/typed", typed, methods=["POST"])
    assert_openai_error(await post(cluster, {"value": "nope"}, path="/typed"), 400, "invalid_request")


async def test_models_health_and_metrics(cluster_factory):
    cluster = await cluster_factory()
    models = (await cluster.client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llava"]
    health = await cluster.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert (await post(cluster, TEXT)).status_code == 200
    metrics = (await cluster.client.get("/metrics")).text
    assert 'epd_proxy_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in metrics
    await cluster.servers[0].set_ready(False)  # the only PD drains
    await wait_until_async(lambda: cluster.client.get("/health"), lambda r: r.status_code == 503)
    health = await cluster.client.get("/health")
    assert health.json()["pd"] == {cluster.pd.address: False}


async def test_proxy_liveness_probe_answers_through_a_backend_outage(cluster_factory):
    """Security review: ``/health/live`` (the Kubernetes liveness probe) ignores the backends."""
    cluster = await cluster_factory(api_key="k-123")
    await cluster.servers[0].set_ready(False)  # the only PD drains: readiness fails
    await wait_until_async(lambda: cluster.client.get("/health"), lambda r: r.status_code == 503)
    live = await cluster.client.get("/health/live")  # no key needed, nothing named
    assert live.status_code == 200 and live.json() == {"status": "alive"}


async def test_health_needs_an_encoder_when_encoders_are_configured(cluster_factory):
    cluster = await cluster_factory()
    await cluster.servers[1].set_ready(False)
    await wait_until_async(lambda: cluster.client.get("/health"), lambda r: r.status_code == 503)


async def wait_until_async(call, predicate, timeout: float = 5.0):
    for _ in range(int(timeout / 0.02)):
        reply = await call()
        if predicate(reply):
            return reply
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_stream_client_disconnect_before_first_token_cancels_and_aborts(cluster_factory):
    cluster = await cluster_factory(http=True)
    pd = cluster.pd
    pd.hold_first_token.clear()
    body = {"messages": [image_message(png_data_url())], "stream": True}

    async def consume() -> None:
        async with cluster.client.stream("POST", "/v1/chat/completions", json=body) as reply:
            async for _ in reply.aiter_bytes():
                pass

    task = asyncio.create_task(consume())
    await wait_until(lambda: pd.num_active == 1)
    task.cancel()  # the client goes away
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: pd.num_active == 0 and pd.aborts)
    assert pd.aborts == [pd.generates[0].request_id]
    assert pd.generate_cancelled == 1


async def test_stream_client_disconnect_mid_stream_cancels_and_aborts(cluster_factory):
    cluster = await cluster_factory(http=True)
    pd = cluster.pd
    pd.hold_after_first.clear()
    async with cluster.client.stream("POST", "/v1/chat/completions", json={**TEXT, "stream": True}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if '"Hello"' in line:
                break  # got the first token; now leave
    await wait_until(lambda: pd.num_active == 0 and pd.aborts)
    assert pd.aborts == [pd.generates[0].request_id]
    assert pd.generate_cancelled == 1


async def test_non_stream_client_disconnect_cancels_and_aborts(cluster_factory):
    cluster = await cluster_factory(http=True)
    pd = cluster.pd
    pd.hold_first_token.clear()
    request = cluster.client.post("/v1/chat/completions", json=TEXT)
    task = asyncio.create_task(request)
    await wait_until(lambda: pd.num_active == 1)
    task.cancel()  # closes the connection
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: pd.num_active == 0 and pd.aborts)
    assert pd.aborts == [pd.generates[0].request_id]


async def test_openai_client_non_stream_and_stream(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        messages = [image_message(png_data_url(), text="Describe.")]
        completion = await client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=5)
        assert completion.choices[0].message.content == "Hello world!"
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage.prompt_tokens_details.cached_tokens == 0
        assert completion.usage.model_extra["epd"]["num_images"] == 1

        stream = await client.chat.completions.create(
            model="tiny-llava",
            messages=messages,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world!"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == 3

        text = await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3)
        assert text.choices[0].text == "Hello world!"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny-llava"]
    finally:
        await client.close()


async def test_openai_client_sees_errors(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        cluster.pd.generate_failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=1000)
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="tiny-llava", messages=TEXT["messages"], stream=True)
        assert caught.value.status_code == 503
        assert caught.value.response.headers["retry-after"] == "1"

        cluster.pd.generate_failure = None
        cluster.pd.fail_after_first = Failure(grpc.StatusCode.INTERNAL)
        stream = await client.chat.completions.create(model="tiny-llava", messages=TEXT["messages"], stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass

        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="other", messages=TEXT["messages"])
    finally:
        await client.close()


async def test_allowed_https_image_is_fetched_pinned_and_encoded(cluster_factory):
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buffer, format="PNG")
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, content=buffer.getvalue())

    async def resolver(host: str, port: int) -> list[str]:
        return {"img.example.com": ["93.184.215.14"]}[host]

    media = MediaFetcher(MediaPolicy(("img.example.com",)), resolver=resolver, transport=httpx.MockTransport(handler))
    cluster = await cluster_factory(fetcher=media)
    try:
        remote = await post(cluster, {"messages": [image_message("https://img.example.com/cat.png")]})
        assert remote.status_code == 200, remote.text
        assert requests[0].url.host == "93.184.215.14" and requests[0].headers["host"] == "img.example.com"
        inline = await post(cluster, {"messages": [image_message(png_data_url((200, 30, 30)))]})
        assert inline.status_code == 200
        first, second = cluster.pd.preallocates
        assert first.items[0].mm_hash == second.items[0].mm_hash  # same pixels, same hash, however sent
        refused = await post(cluster, {"messages": [image_message(f"https://evil.example.net/{SECRET}.png")]})
        assert_openai_error(refused, 400, "image_url_not_allowed")
        assert len(requests) == 1 and len(cluster.pd.preallocates) == 2
    finally:
        await media.aclose()

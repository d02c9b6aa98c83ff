"""The PD image window through the proxy: image requests beyond it start only when one ahead has its first
token (or ends); a request waiting past its deadline is a 504."""

from __future__ import annotations

import asyncio

from proxy_doubles import image_message, png_data_url, wait_until


def image_request(color: tuple[int, int, int]) -> dict:
    return {"messages": [image_message(png_data_url(color))], "max_tokens": 4}


async def test_image_requests_beyond_the_window_start_at_a_first_token(cluster_factory):
    cluster = await cluster_factory(pd_image_window=1)
    pd = cluster.pd
    pd.hold_first_token.clear()
    first = asyncio.create_task(cluster.client.post("/v1/chat/completions", json=image_request((255, 0, 0))))
    await wait_until(lambda: len(pd.preallocates) == 1 and len(cluster.encoder.encodes) == 1)
    second = asyncio.create_task(cluster.client.post("/v1/chat/completions", json=image_request((0, 0, 255))))
    await asyncio.sleep(0.2)
    assert len(pd.preallocates) == 1 and len(cluster.encoder.encodes) == 1  # the second waits in the proxy
    pd.hold_first_token.set()
    replies = await asyncio.gather(first, second)
    assert [r.status_code for r in replies] == [200, 200]
    assert len(pd.preallocates) == 2 and len(cluster.encoder.encodes) == 2
    timings = [r.json()["usage"]["epd"]["timings_ms"] for r in replies]
    assert timings[0]["window"] < 100 < timings[1]["window"]
    assert cluster.app.state.proxy.pipeline.calls.windows.num_inside(pd.address) == 0  # every place given back


async def test_a_request_waiting_for_the_window_past_its_deadline_is_504(cluster_factory):
    cluster = await cluster_factory(pd_image_window=1, request_timeout_s=5.0)
    pd = cluster.pd
    pd.hold_first_token.clear()
    first = asyncio.create_task(cluster.client.post("/v1/chat/completions", json=image_request((255, 0, 0))))
    await wait_until(lambda: len(pd.preallocates) == 1)
    late = await cluster.client.post(
        "/v1/chat/completions", json=image_request((0, 255, 0)), headers={"X-Request-Timeout": "0.3"}
    )
    assert late.status_code == 504, late.text
    assert late.json()["error"]["code"] == "timeout"
    assert len(pd.preallocates) == 1  # it never reached PD
    pd.hold_first_token.set()
    assert (await first).status_code == 200
    windows = cluster.app.state.proxy.pipeline.calls.windows
    assert windows.num_inside(pd.address) == 0 and windows.num_waiting() == 0


async def test_a_failed_request_gives_its_place_to_the_next(cluster_factory):
    cluster = await cluster_factory(pd_image_window=1)
    pd = cluster.pd
    pd.hold_first_token.clear()
    first = asyncio.create_task(cluster.client.post("/v1/chat/completions", json=image_request((255, 0, 0))))
    await wait_until(lambda: len(pd.preallocates) == 1)
    second = asyncio.create_task(cluster.client.post("/v1/chat/completions", json=image_request((0, 0, 255))))
    await asyncio.sleep(0.1)
    first.cancel()  # the client goes away before its first token
    await wait_until(lambda: len(pd.preallocates) == 2)  # its place went to the second
    pd.hold_first_token.set()
    assert (await second).status_code == 200
    await wait_until(lambda: cluster.app.state.proxy.pipeline.calls.windows.num_inside(pd.address) == 0)

"""Limits before work at the proxy, over real HTTP: huge bodies and texts, the image queue, text beside images.

Issue 16 probes: a 30 MB body took 65 s to be refused (tokenized first);
text-only requests timed out behind image decoding on a shared pool.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from proxy_doubles import image_message, png_data_url, wait_until

TEXT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
MB = 1_000_000


def _huge_chat(num_bytes: int) -> bytes:
    """A chat request of ``num_bytes`` bytes, nearly all of it one user message."""
    head, tail = b'{"messages":[{"role":"user","content":"', b'"}],"max_tokens":4}'
    return head + b"a" * (num_bytes - len(head) - len(tail)) + tail


async def test_a_30_mb_text_is_refused_before_tokenizing(cluster_factory):
    cluster = await cluster_factory(http=True)  # the default 32 MiB body limit lets it in
    body = _huge_chat(30 * MB)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client:
        started = time.monotonic()
        reply = await client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        elapsed = time.monotonic() - started
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and "aaaa" not in error["message"]
    assert cluster.pd.generates == [] and cluster.pd.preallocates == []
    print(f"30 MB text body: HTTP {reply.status_code} after {elapsed:.3f} s")  # reported, not asserted


async def test_a_30_mb_body_over_the_limit_is_413_from_its_content_length(cluster_factory):
    cluster = await cluster_factory(http=True, max_body_bytes=16 * 2**20)
    body = _huge_chat(30 * MB)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client:
        started = time.monotonic()
        try:
            reply = await client.post(
                "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
            )
        except httpx.WriteError:  # the server may answer and close before the client finished writing
            reply = None
        elapsed = time.monotonic() - started
    if reply is not None:
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert cluster.pd.generates == []
    print(f"30 MB body over a 16 MiB limit: {reply.status_code if reply else 'closed'} after {elapsed:.3f} s")


async def test_text_requests_are_served_while_every_image_thread_is_busy(cluster_factory):
    # Defect 3: text tokenization waited behind image decoding on one shared pool.
    cluster = await cluster_factory(image_threads=1, image_queue=4, preprocess_threads=1)
    preprocessor = cluster.app.state.proxy.preprocessor
    gate, busy = threading.Event(), threading.Event()
    real = preprocessor.chat_images

    def held(sources, *rest):
        busy.set()
        assert gate.wait(30), "test gate never opened"
        return real(sources, *rest)

    preprocessor.chat_images = held
    try:
        images = [
            asyncio.create_task(
                cluster.client.post(
                    "/v1/chat/completions", json={"messages": [image_message(png_data_url((i, 2, 3)))], "max_tokens": 2}
                )
            )
            for i in range(3)
        ]
        await asyncio.to_thread(busy.wait, 30)
        for _ in range(3):  # while the image thread is held and two image requests queue behind it
            reply = await cluster.client.post("/v1/chat/completions", json=TEXT, headers={"X-Request-Timeout": "5"})
            assert reply.status_code == 200
        assert not gate.is_set() and not any(task.done() for task in images)
    finally:
        gate.set()
    assert [r.status_code for r in await asyncio.gather(*images)] == [200, 200, 200]


async def test_a_full_image_queue_is_a_clean_503_and_frees_up(cluster_factory):
    cluster = await cluster_factory(image_threads=1, image_queue=1)
    state = cluster.app.state.proxy
    gate = threading.Event()
    real = state.preprocessor.chat_images

    def held(sources, *rest):
        assert gate.wait(30), "test gate never opened"
        return real(sources, *rest)

    state.preprocessor.chat_images = held
    body = {"messages": [image_message(png_data_url())], "max_tokens": 2}
    try:
        admitted = [asyncio.create_task(cluster.client.post("/v1/chat/completions", json=body)) for _ in range(2)]
        await wait_until(lambda: state.image_pool.num_admitted == 2)
        refused = await cluster.client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        assert (await cluster.client.post("/v1/chat/completions", json=TEXT)).status_code == 200
    finally:
        gate.set()
    assert [r.status_code for r in await asyncio.gather(*admitted)] == [200, 200]
    await wait_until(lambda: state.image_pool.num_admitted == 0)
    assert (await cluster.client.post("/v1/chat/completions", json=body)).status_code == 200


async def test_work_before_limits_a_large_body_is_parsed_off_the_event_loop_and_refused_before_rendering(
    cluster_factory, monkeypatch
):
    """Second review, 4: two legal 28.6 MiB bodies stretched another stream's largest token gap to 6.5 s
    (parsed on the event loop; every message rendered before the length check)."""
    import services.proxy.intake as intake
    from services.proxy.web.http_util import parse_body

    cluster = await cluster_factory(http=True)
    parsed_on: list[str] = []

    def recording_parse(raw, model):
        parsed_on.append(threading.current_thread().name)
        return parse_body(raw, model)

    monkeypatch.setattr(intake, "parse_body", recording_parse)
    rendered: list[int] = []
    preprocessor = cluster.app.state.proxy.preprocessor
    real_render = preprocessor.render
    monkeypatch.setattr(preprocessor, "render", lambda *args: rendered.append(1) or real_render(*args))
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client:
        small = await client.post("/v1/chat/completions", json=TEXT)
        large = await client.post(
            "/v1/chat/completions", content=_huge_chat(28 * MB), headers={"Content-Type": "application/json"}
        )
    assert small.status_code == 200 and large.status_code == 400
    assert large.json()["error"]["code"] == "context_length_exceeded"
    # The small body was parsed inline, on the event loop's thread; the large one on the text pool.
    assert parsed_on[0] == threading.current_thread().name and parsed_on[1].startswith("proxy-text")
    assert rendered == [1]  # the small request only: the large one was refused from its text's length


async def test_work_before_limits_a_body_of_too_many_messages_is_refused_before_parsing(cluster_factory, monkeypatch):
    """Second review, 4: the cost of parsing a body grows with its messages; too many are refused unparsed."""
    import json

    import services.proxy.intake as intake

    cluster = await cluster_factory(http=True, max_messages=8)
    parsed: list[int] = []
    real_parse = intake.parse_body
    monkeypatch.setattr(intake, "parse_body", lambda raw, model: parsed.append(1) or real_parse(raw, model))
    message = {"role": "user", "content": "hi"}
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client:
        many = await client.post("/v1/chat/completions", json={**TEXT, "messages": [message] * 9})
        parts = [{"type": "text", "text": "x"}] * (16 * 8 + 1)
        many_parts = await client.post(
            "/v1/chat/completions", json={**TEXT, "messages": [{**message, "content": parts}]}
        )
        eight = await client.post("/v1/chat/completions", json={**TEXT, "messages": [message] * 8})
        quoted = await client.post(  # "role" inside a string is escaped: it does not count
            "/v1/chat/completions", json={**TEXT, "messages": [{**message, "content": json.dumps({"role": 1}) * 20}]}
        )
    for reply in (many, many_parts):
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    assert eight.status_code == 200 and quoted.status_code == 200
    assert parsed == [1, 1]  # only the two bodies within the limit were parsed

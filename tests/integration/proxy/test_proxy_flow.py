"""The proxy app against test-double PD and encoder gRPC servers: the request flow."""

from __future__ import annotations

import asyncio
import json

import grpc
from proxy_doubles import Failure, image_message, png_data_url, wait_until

from services.common import grpc_utils
from services.common.pb import epd_pb2
from services.proxy.backends.routing import rendezvous_weight

TEXT = {"model": "tiny-llava", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


def sse_payloads(body: str) -> list:
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] if e == "data: [DONE]" else json.loads(e[len("data: ") :]) for e in events]


async def test_text_request_goes_straight_to_generate(cluster_factory):
    cluster = await cluster_factory()
    reply = await cluster.client.post("/v1/chat/completions", json={**TEXT, "temperature": 0, "seed": 7, "stop": "x"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world!"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny-llava"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["usage"]["epd"]["image_tokens"] == 0
    pd = cluster.pd
    assert pd.preallocates == [] and cluster.encoder.encodes == []
    [generate] = pd.generates
    assert generate.request_id == body["id"]
    assert pd.request_ids_seen == [body["id"]]  # propagated in gRPC metadata
    assert generate.mm_items == [] and len(generate.prompt_token_ids) > 3
    sampling = generate.sampling
    assert sampling.HasField("temperature") and sampling.temperature == 0.0
    assert sampling.seed == 7 and list(sampling.stop) == ["x"] and sampling.max_tokens == 8
    assert pd.aborts == []  # clean finish: nothing to release


async def test_image_request_preallocates_then_encodes_and_generates(cluster_factory):
    cluster = await cluster_factory()
    red, blue = png_data_url((255, 0, 0)), png_data_url((0, 0, 255), size=(20, 50))
    request = {"model": "tiny-llava", "messages": [image_message(red, blue)], "max_tokens": 4}
    reply = await cluster.client.post("/v1/chat/completions", json=request)
    assert reply.status_code == 200, reply.text
    pd, encoder = cluster.pd, cluster.encoder
    [pre] = pd.preallocates
    [generate] = pd.generates
    encodes = encoder.encodes  # one Encode call per image, in parallel
    request_id = reply.json()["id"]
    assert pre.request_id == generate.request_id == request_id
    assert {e.request_id for e in encodes} == {request_id}
    # Items in prompt order, each span of image tokens inside the prompt.
    assert len(pre.items) == 2 and pre.items[0].offset < pre.items[1].offset
    assert pre.items[0].mm_hash != pre.items[1].mm_hash
    assert list(pre.items) == list(generate.mm_items)
    assert list(pre.prompt_token_ids) == list(generate.prompt_token_ids)
    image_token_ids = {generate.prompt_token_ids[i.offset] for i in pre.items}
    assert len(image_token_ids) == 1
    for item in pre.items:
        span = generate.prompt_token_ids[item.offset : item.offset + item.num_tokens]
        assert set(span) == image_token_ids
    # Encode carries the reservations Preallocate granted and the PD to push to.
    assert {e.pd_address for e in encodes} == {pd.address}
    assert sorted((i.mm_hash, i.reservation_id) for e in encodes for i in e.items) == sorted(
        (item.mm_hash, f"{request_id}/res{index}") for index, item in enumerate(pre.items)
    )
    # Defect 12: no --lease-ms means the request's deadline (10 s here), not PD's default.
    assert 9_000 < pre.lease_ms <= 10_000
    usage = reply.json()["usage"]
    assert usage["epd"]["image_tokens"] == sum(i.num_tokens for i in pre.items)
    assert usage["epd"]["num_images"] == 2
    assert {"preprocess", "preallocate", "encode", "total"} <= set(usage["epd"]["timings_ms"])


async def test_without_a_configured_lease_the_lease_is_the_request_deadline(cluster_factory):
    cluster = await cluster_factory(request_timeout_s=60.0)
    request = {"messages": [image_message(png_data_url())], "max_tokens": 2}
    reply = await cluster.client.post("/v1/chat/completions", json=request, headers={"X-Request-Timeout": "45"})
    assert reply.status_code == 200
    assert 40_000 < cluster.pd.preallocates[0].lease_ms <= 45_000


async def test_configured_lease_is_sent(cluster_factory):
    cluster = await cluster_factory(lease_ms=5000, request_timeout_s=10.0)
    request = {"messages": [image_message(png_data_url())], "max_tokens": 2}
    assert (await cluster.client.post("/v1/chat/completions", json=request)).status_code == 200
    assert cluster.pd.preallocates[0].lease_ms == 5000


async def test_ready_items_are_not_encoded(cluster_factory):
    cluster = await cluster_factory()
    red, blue = png_data_url((255, 0, 0)), png_data_url((0, 0, 255))
    request = {"messages": [image_message(red)], "max_tokens": 4}
    first = await cluster.client.post("/v1/chat/completions", json=request)
    assert first.status_code == 200
    cluster.pd.ready_hashes.add(cluster.pd.preallocates[0].items[0].mm_hash)
    second = await cluster.client.post("/v1/chat/completions", json={**request, "messages": [image_message(red, blue)]})
    assert second.status_code == 200, second.text
    assert [len(e.items) for e in cluster.encoder.encodes] == [1, 1]
    assert cluster.encoder.encodes[1].items[0].mm_hash == cluster.pd.preallocates[1].items[1].mm_hash
    assert second.json()["usage"]["epd"]["num_images_ready"] == 1


async def test_images_spread_over_encoders_with_affinity(cluster_factory):
    cluster = await cluster_factory(num_encoders=2)
    urls = [png_data_url((i * 40, 0, 0)) for i in range(6)]
    request = {"messages": [image_message(*urls)], "max_tokens": 2}
    assert (await cluster.client.post("/v1/chat/completions", json=request)).status_code == 200
    placement = {i.mm_hash: e.address for e in cluster.encoders for call in e.encodes for i in call.items}
    assert len(placement) == 6
    assert sum(len(e.encodes) for e in cluster.encoders) == 6  # one call per image, in parallel
    for mm_hash, address in placement.items():  # each on its rendezvous owner
        assert address == max(cluster.encoders, key=lambda e: rendezvous_weight(e.address, mm_hash)).address
    for encoder in cluster.encoders:
        encoder.encodes.clear()
    assert (await cluster.client.post("/v1/chat/completions", json=request)).status_code == 200
    again = {i.mm_hash: e.address for e in cluster.encoders for call in e.encodes for i in call.items}
    assert again == placement  # same image, same encoder


async def test_streaming_chunks_and_done(cluster_factory):
    cluster = await cluster_factory()
    request = {**TEXT, "stream": True, "stream_options": {"include_usage": True}}
    reply = await cluster.client.post("/v1/chat/completions", json=request)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(reply.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e["choices"])
    assert text == "Hello world!"
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"


async def test_length_finish_reason(cluster_factory):
    cluster = await cluster_factory()
    cluster.pd.finish_reason = epd_pb2.FINISH_REASON_LENGTH
    reply = await cluster.client.post("/v1/chat/completions", json=TEXT)
    assert reply.json()["choices"][0]["finish_reason"] == "length"


async def test_resource_exhausted_is_503_with_retry_after_and_no_encode(cluster_factory):
    cluster = await cluster_factory()
    cluster.pd.preallocate_failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=2500)
    request = {"messages": [image_message(png_data_url())], "stream": True}
    reply = await cluster.client.post("/v1/chat/completions", json=request)
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "3"
    assert reply.json()["error"]["code"] == "overloaded"
    assert cluster.encoder.encodes == [] and cluster.pd.generates == []


async def test_admission_refusal_fails_over_to_another_pd_with_a_fresh_id(cluster_factory):
    cluster = await cluster_factory(num_pds=2)
    for pd in cluster.pds:
        pd.preallocate_failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=100)
    busy = cluster.pds[0]
    cluster.pds[1].preallocate_failure = None
    busy_first = False
    for _ in range(4):  # ties rotate, so some request hits the busy PD first
        reply = await cluster.client.post("/v1/chat/completions", json={"messages": [image_message(png_data_url())]})
        assert reply.status_code == 200, reply.text
        busy_first |= bool(busy.preallocates) and busy.preallocates[-1].request_id == reply.json()["id"]
        if busy_first:
            retried = cluster.pds[1].preallocates[-1].request_id
            assert retried != reply.json()["id"] and retried.startswith(reply.json()["id"])
            assert cluster.encoder.encodes[-1].pd_address == cluster.pds[1].address
            break
    assert busy_first
    assert busy.generates == [] and busy.aborts  # the refused attempt was released (idempotent Abort)


async def test_encoder_failure_aborts_pd_and_returns_clean_error(cluster_factory):
    cluster = await cluster_factory()
    cluster.encoder.failure = Failure(grpc.StatusCode.INTERNAL)
    reply = await cluster.client.post("/v1/chat/completions", json={"messages": [image_message(png_data_url())]})
    assert reply.status_code == 500
    assert reply.json()["error"]["code"] == "internal_error"
    pd = cluster.pd
    assert pd.aborts == [pd.preallocates[0].request_id]
    await asyncio.sleep(0.05)
    assert pd.num_active == 0 and pd.generate_cancelled == 1  # the waiting Generate did not hang


async def test_a_push_that_fails_after_pd_prefilled_does_not_fail_the_request(cluster_factory):
    """PD prefilled from the embedding another request's push brought and streamed; this request's own push
    then failed at PD (its reservation already gone). The answer is whole, without an error event."""
    cluster = await cluster_factory(http=True)  # real HTTP: the client reads the stream as it comes
    pd, encoder = cluster.pd, cluster.encoder
    pd.wait_for_pushes = False
    pd.hold_after_first.clear()
    encoder.hold.clear()
    encoder.push_failures[pd.address] = Failure(grpc.StatusCode.FAILED_PRECONDITION, failed_hop=grpc_utils.PUSH_HOP)
    request = {"messages": [image_message(png_data_url())], "stream": True, "max_tokens": 4}
    async with cluster.client.stream("POST", "/v1/chat/completions", json=request) as reply:
        assert reply.status_code == 200
        lines = reply.aiter_lines()
        while "Hello" not in await anext(lines):  # the first token reached the client
            pass
        encoder.hold.set()
        await wait_until(lambda: encoder.num_answered == 1)  # the push failed...
        pd.hold_after_first.set()  # ... and PD goes on
        rest = "\n".join([line async for line in lines])
    assert '"error"' not in rest and " world" in rest and "[DONE]" in rest
    assert pd.aborts == []


async def test_a_push_that_fails_before_pd_prefilled_still_fails_the_request(cluster_factory):
    cluster = await cluster_factory()
    pd, encoder = cluster.pd, cluster.encoder
    encoder.push_failures[pd.address] = Failure(grpc.StatusCode.FAILED_PRECONDITION, failed_hop=grpc_utils.PUSH_HOP)
    reply = await cluster.client.post("/v1/chat/completions", json={"messages": [image_message(png_data_url())]})
    assert reply.status_code == 500
    assert pd.aborts == [pd.preallocates[0].request_id]


async def test_encoder_overload_is_503(cluster_factory):
    cluster = await cluster_factory()
    cluster.encoder.failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=1200)
    reply = await cluster.client.post("/v1/chat/completions", json={"messages": [image_message(png_data_url())]})
    assert reply.status_code == 503 and reply.headers["retry-after"] == "2"
    assert cluster.pd.aborts


async def test_unavailable_encoder_fails_over_to_the_next(cluster_factory):
    cluster = await cluster_factory(num_encoders=2)
    cluster.encoders[0].failure = Failure(grpc.StatusCode.UNAVAILABLE)
    cluster.encoders[1].failure = None
    for color in range(4):
        reply = await cluster.client.post(
            "/v1/chat/completions", json={"messages": [image_message(png_data_url((color, 9, 9)))]}
        )
        assert reply.status_code == 200, reply.text
    assert len(cluster.encoders[1].encodes) == 4


async def test_error_mid_stream_ends_with_error_event_and_done(cluster_factory):
    cluster = await cluster_factory()
    cluster.pd.fail_after_first = Failure(grpc.StatusCode.INTERNAL)
    reply = await cluster.client.post("/v1/chat/completions", json={**TEXT, "stream": True})
    assert reply.status_code == 200
    events = sse_payloads(reply.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "internal_error"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert cluster.pd.aborts == [cluster.pd.generates[0].request_id]


async def test_generate_error_before_first_token_maps_status(cluster_factory):
    cluster = await cluster_factory()
    cluster.pd.generate_failure = Failure(grpc.StatusCode.INVALID_ARGUMENT)
    reply = await cluster.client.post("/v1/chat/completions", json={**TEXT, "stream": True})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "The request was rejected by the model server as invalid."


async def test_deadline_is_504(cluster_factory):
    cluster = await cluster_factory(request_timeout_s=0.3)
    cluster.pd.hold_first_token.clear()
    reply = await cluster.client.post("/v1/chat/completions", json=TEXT)
    assert reply.status_code == 504
    assert reply.json()["error"]["code"] == "timeout"
    await wait_until(lambda: cluster.pd.aborts)  # the answer leaves at the deadline; the Abort follows it


async def test_completions_text_and_token_ids(cluster_factory):
    cluster = await cluster_factory()
    reply = await cluster.client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello world!"
    assert body["id"].startswith("cmpl-")
    reply = await cluster.client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "stream": True})
    assert sse_payloads(reply.text)[-1] == "[DONE]"
    assert list(cluster.pd.generates[-1].prompt_token_ids) == [5, 6, 7]
    assert cluster.pd.preallocates == []

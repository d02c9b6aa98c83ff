"""Access lines across the cluster: one per request per service, one request id, no prompt text.

A whole cluster (proxy, encoder, PD) runs in this process, so ``caplog``
sees every service's records. Each test sends requests whose prompt holds
a marker string and checks the lines written for them.
"""

from __future__ import annotations

import logging
import time

import grpc
import httpx
import pytest
from cluster_support import InProcessCluster
from oracle_support import data_url, make_image, user_message

from services.common.grpc_utils import REQUEST_ID_KEY
from services.common.pb import epd_pb2, epd_pb2_grpc

SECRET = "zebra-unicorn-4711"
"""Marker text in every prompt: it must appear in no log record."""

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cluster = InProcessCluster(str(tiny_model_dir), num_encoders=1, num_pds=1).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def client(cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        yield http
    assert cluster.leaks() == {}


def access_lines(caplog, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


def wait_for_lines(caplog, expected: dict[str, int], timeout: float = 10) -> dict[str, list[logging.LogRecord]]:
    """The access lines per event once each event has its expected count (a PD line may follow the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {event: access_lines(caplog, event) for event in expected}
        if {event: len(lines) for event, lines in found.items()} == expected or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def assert_no_prompt_text(caplog, *secrets: str) -> None:
    for record in caplog.records:
        if record.name.startswith(("httpx", "httpcore")):
            continue  # this test's own HTTP client, not a service
        text = record.getMessage() + " " + " ".join(str(value) for value in record.__dict__.values())
        for secret in secrets:
            assert secret not in text, f"{record.name} logged request content"


def chat_body(content: list | str, stream: bool = False) -> dict:
    return {
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "user", "content": content}],
    }


def test_one_image_request_has_one_line_per_service_with_one_request_id(cluster, client, caplog):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="services.pd.servicer")  # Preallocate and push lines
    image = make_image(3)
    message = user_message(f"What is shown? {SECRET}", [image])
    reply = client.post(
        "/chat/completions", json=chat_body(message["content"]), headers={"X-Request-Id": "client-trace.42"}
    )
    assert reply.status_code == 200
    body = reply.json()
    request_id = body["id"]
    assert reply.headers["x-request-id"] == request_id

    lines = wait_for_lines(caplog, {"http": 1, "encode": 1, "generate": 1, "preallocate": 1, "push": 1})
    (http,), (encode,), (generate,) = lines["http"], lines["encode"], lines["generate"]
    for record in (http, encode, generate, *lines["preallocate"], *lines["push"]):
        assert record.request_id == request_id, record.event
        assert record.status in ("OK", 200)
    usage = body["usage"]
    assert (http.route, http.method, http.status, http.model, http.stream) == (
        "/v1/chat/completions",
        "POST",
        200,
        "tiny",
        False,
    )
    assert http.client_request_id == "client-trace.42"
    assert (http.images, http.prompt_tokens, http.completion_tokens) == (1, usage["prompt_tokens"], MAX_TOKENS)
    assert http.outcome == "ok" and http.pd == cluster.pd_addresses[0] and http.pd_attempts == 1
    assert http.ttft_ms is not None and http.duration_ms >= http.ttft_ms
    assert (encode.items, encode.cache_hits) == (1, 0)
    assert (generate.prompt_tokens, generate.completion_tokens, generate.finish_reason) == (
        usage["prompt_tokens"],
        MAX_TOKENS,
        "length",
    )
    assert generate.image_tokens > 0 and generate.cached_tokens == 0
    assert generate.ttft_ms is not None and generate.levelno == logging.INFO
    assert lines["preallocate"][0].levelno == lines["push"][0].levelno == logging.DEBUG
    assert lines["push"][0].num_bytes > 0
    assert_no_prompt_text(caplog, SECRET, data_url(image)[len("data:image/png;base64,") :][:64])


def test_streaming_text_request_and_an_unusable_client_request_id(cluster, client, caplog):
    caplog.set_level(logging.INFO)
    with client.stream(
        "POST",
        "/chat/completions",
        json=chat_body(f"Tell me {SECRET}", stream=True),
        headers={"X-Request-Id": 'bad id "forged=line"'},
    ) as reply:
        assert reply.status_code == 200
        events = [line for line in reply.iter_lines() if line.startswith("data: {")]
        header_id = reply.headers["x-request-id"]
    assert events and f'"id":"{header_id}"' in events[0].replace(" ", "")

    lines = wait_for_lines(caplog, {"http": 1, "encode": 0, "generate": 1})
    (http,), (generate,) = lines["http"], lines["generate"]
    assert http.request_id == generate.request_id == header_id
    assert http.client_request_id is None  # dropped, not logged
    assert (http.stream, http.images, http.completion_tokens, http.status) == (True, 0, MAX_TOKENS, 200)
    assert generate.status == "OK" and generate.completion_tokens == MAX_TOKENS
    assert_no_prompt_text(caplog, SECRET, "forged")


def test_refused_requests_get_a_line_with_a_fresh_id_and_no_echo(cluster, client, caplog):
    caplog.set_level(logging.INFO)
    bad = client.post("/chat/completions", json={**chat_body(f"x {SECRET}"), "max_tokens": -1})
    assert bad.status_code == 400
    unknown = client.post(f"/{SECRET}", json={})
    assert unknown.status_code == 404

    lines = wait_for_lines(caplog, {"http": 2, "generate": 0})
    first, second = lines["http"]
    assert (first.route, first.status) == ("/v1/chat/completions", 400)
    assert (second.route, second.status) == ("other", 404)  # the path is not echoed
    assert first.request_id.startswith("req-") and first.request_id == bad.headers["x-request-id"]
    assert second.request_id == unknown.headers["x-request-id"] != first.request_id
    assert getattr(first, "model", None) is None  # refused before the model was resolved
    assert_no_prompt_text(caplog, SECRET)


def test_pd_lines_for_a_refused_and_a_cancelled_generation(cluster, caplog):
    """Driven on PD directly: an invalid request and one whose client goes away mid-stream."""
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(cluster.pd_addresses[0]) as channel:
        stub = epd_pb2_grpc.PrefillDecodeStub(channel)
        invalid = epd_pb2.GenerateRequest(
            request_id="log-test-invalid", prompt_token_ids=[], sampling=epd_pb2.SamplingParams(max_tokens=4)
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(invalid, metadata=((REQUEST_ID_KEY, "not a plain id"),), timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        long = epd_pb2.GenerateRequest(
            request_id="log-test-cancel",
            prompt_token_ids=[5, 6, 7],
            sampling=epd_pb2.SamplingParams(temperature=0, max_tokens=400),
        )
        call = stub.Generate(long, metadata=((REQUEST_ID_KEY, "log-test-cancel"),), timeout=30)
        assert next(call).token_ids
        call.cancel()
    lines = wait_for_lines(caplog, {"generate": 2})
    by_id = {record.request_id: record for record in lines["generate"]}
    assert set(by_id) == {"-", "log-test-cancel"}  # an id that is not plain is not logged
    assert (by_id["-"].status, by_id["-"].completion_tokens, by_id["-"].finish_reason) == ("INVALID_ARGUMENT", 0, None)
    cancelled = by_id["log-test-cancel"]
    assert cancelled.status == "CANCELLED" and cancelled.finish_reason is None
    assert 1 <= cancelled.completion_tokens < 400 and cancelled.ttft_ms is not None
    assert cluster.leaks() == {}

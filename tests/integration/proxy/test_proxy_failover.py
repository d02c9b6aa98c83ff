"""Health-aware routing, failover, circuit breaking and deadlines, against test-double backends."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from proxy_doubles import (
    Failure,
    FakePd,
    image_message,
    png_data_url,
    proxy_config,
    serve_pd,
    wait_until,
)

from services.common.pb import epd_pb2
from services.common.security import InternalSecurity
from services.proxy.app import create_app
from services.proxy.backends.instances import BreakerState, Readiness
from services.proxy.backends.pools import Backends
from services.proxy.backends.routing import rendezvous_weight
from services.proxy.config import ProxyConfig
from services.proxy.lifespan import connect_backends

S = grpc.StatusCode
TEXT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


def backends(cluster) -> Backends:
    return cluster.app.state.proxy.backends


def instance(cluster, address: str):
    return next(i for i in [*backends(cluster).pds, *backends(cluster).encoders] if i.address == address)


async def post(cluster, body=TEXT, **kwargs) -> httpx.Response:
    return await cluster.client.post("/v1/chat/completions", json=body, **kwargs)


def image_owned_by(cluster, owner, other) -> str:
    """A data URL whose image ranks ``owner`` first among the two encoders."""
    preprocessor = cluster.app.state.proxy.preprocessor
    for shade in range(256):
        url = png_data_url((shade, 77, 3))
        mm_hash = preprocessor.chat_prompt([image_message(url)]).images[0].mm_hash
        if rendezvous_weight(owner.address, mm_hash) > rendezvous_weight(other.address, mm_hash):
            return url
    raise AssertionError("no image hashed to the owner")


# --------------------------------------------------------------------------- health


async def test_a_not_ready_pd_gets_no_traffic_until_it_recovers(cluster_factory):
    cluster = await cluster_factory(num_pds=2)
    pd0, pd1 = cluster.pds
    await cluster.servers[0].set_ready(False)
    await wait_until(lambda: instance(cluster, pd0.address).readiness is Readiness.NOT_READY)
    for _ in range(4):
        assert (await post(cluster)).status_code == 200
    assert pd0.generates == [] and len(pd1.generates) == 4
    await cluster.servers[0].set_ready(True)
    await wait_until(lambda: instance(cluster, pd0.address).readiness is Readiness.READY)
    for _ in range(4):
        assert (await post(cluster)).status_code == 200
    assert pd0.generates  # back in rotation, no proxy restart


async def test_a_dead_pd_is_failed_over_and_a_restarted_one_used_again(cluster_factory):
    cluster = await cluster_factory(num_pds=2)
    pd0, pd1 = cluster.pds
    port = cluster.servers[0].port
    await cluster.servers[0].stop(0)  # the process is gone
    for _ in range(4):  # even before health notices
        assert (await post(cluster)).status_code == 200
    await wait_until(lambda: instance(cluster, pd0.address).readiness is Readiness.NOT_READY)
    health = (await cluster.client.get("/health")).json()
    assert health["pd"] == {pd0.address: False, pd1.address: True}
    cluster.servers[0] = await serve_pd(pd0, port=port)  # same address, back up
    await wait_until(lambda: instance(cluster, pd0.address).readiness is Readiness.READY)
    before = len(pd0.generates)
    for _ in range(4):
        assert (await post(cluster)).status_code == 200
    assert len(pd0.generates) > before


async def test_unavailable_at_admission_retries_with_a_fresh_id(cluster_factory):
    cluster = await cluster_factory(num_pds=2)
    pd0, pd1 = cluster.pds
    pd0.generate_failure = Failure(S.UNAVAILABLE)
    pd1.load = epd_pb2.PdLoad(num_running=50)  # so pd0 is always tried first
    await wait_until(lambda: instance(cluster, pd1.address).load is not None)
    reply = await post(cluster)
    assert reply.status_code == 200, reply.text
    request_id = reply.json()["id"]
    assert pd0.generates[-1].request_id == request_id
    assert pd1.generates[-1].request_id == f"{request_id}-r1"
    assert reply.json()["usage"]["epd"]["num_pd_attempts"] == 2
    metrics = (await cluster.client.get("/metrics")).text
    assert 'epd_proxy_retries_total{code="UNAVAILABLE",kind="pd"} 1.0' in metrics


@pytest.mark.parametrize("policy", ["cache-aware", "least-loaded"])
async def test_get_load_steers_requests_away_from_a_busy_pd(cluster_factory, policy):
    cluster = await cluster_factory(num_pds=2, pd_policy=policy)
    pd0, pd1 = cluster.pds
    # Another proxy's work: least-loaded counts its requests, cache-aware its uncached tokens.
    pd0.load = epd_pb2.PdLoad(num_running=10, num_waiting=5, num_running_tokens=12_000, num_waiting_tokens=3_000)
    await wait_until(lambda: instance(cluster, pd0.address).others_load() == 15)
    await wait_until(lambda: instance(cluster, pd0.address).estimated_tokens() == 15_000)
    for _ in range(6):
        assert (await post(cluster)).status_code == 200
    assert pd0.generates == [] and len(pd1.generates) == 6


async def test_breaker_opens_after_repeated_failures_then_a_probe_closes_it(cluster_factory):
    cluster = await cluster_factory(num_pds=2, breaker_failures=2, breaker_open_s=0.3)
    pd0, pd1 = cluster.pds
    pd0.generate_failure = Failure(S.INTERNAL)  # not retried: the client sees 500s
    statuses = []
    while len(pd0.generates) < 2:
        statuses.append((await post(cluster)).status_code)
    assert statuses.count(500) == 2
    breaker = instance(cluster, pd0.address).breaker
    assert breaker.state is BreakerState.OPEN
    for _ in range(6):
        assert (await post(cluster)).status_code == 200
    assert len(pd0.generates) == 2  # no traffic while open
    pd0.generate_failure = None
    await asyncio.sleep(0.35)  # half-open: one probe may go
    while len(pd0.generates) == 2:
        assert (await post(cluster)).status_code == 200
    assert breaker.state is BreakerState.CLOSED


async def test_a_buffered_request_restarts_on_another_pd_after_a_mid_stream_outage(cluster_factory):
    cluster = await cluster_factory(num_pds=2)
    pd0, pd1 = cluster.pds
    pd0.fail_after_first = Failure(S.UNAVAILABLE)
    pd1.load = epd_pb2.PdLoad(num_running=50)
    await wait_until(lambda: instance(cluster, pd1.address).load is not None)
    reply = await post(cluster)  # not streaming: nothing sent yet
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "Hello world!"
    assert pd1.generates[-1].request_id == reply.json()["id"] + "-r1"
    assert pd0.aborts == [reply.json()["id"]]

    streamed = await post(cluster, {**TEXT, "stream": True})  # streaming: the first byte went out
    assert streamed.status_code == 200
    assert '"code":"backend_unavailable"' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    assert '"finish_reason":"stop"' not in streamed.text


# --------------------------------------------------------------------------- encoders


@pytest.mark.parametrize("code", [S.UNAVAILABLE, S.INTERNAL, S.RESOURCE_EXHAUSTED])
async def test_a_failed_image_moves_to_the_next_encoder(cluster_factory, code):
    cluster = await cluster_factory(num_encoders=2)
    owner, other = cluster.encoders
    owner.next_failures = [Failure(code, retry_after_ms=1500)]
    reply = await post(cluster, {"messages": [image_message(image_owned_by(cluster, owner, other))]})
    assert reply.status_code == 200, reply.text
    assert len(owner.encodes) == 1 and len(other.encodes) == 1
    assert owner.encodes[0].items[0].reservation_id == other.encodes[0].items[0].reservation_id
    if code == S.RESOURCE_EXHAUSTED:
        assert instance(cluster, owner.address).is_busy()  # its images go elsewhere for a while


async def test_every_encoder_failing_is_a_clean_error_after_bounded_attempts(cluster_factory):
    cluster = await cluster_factory(num_encoders=2)
    for encoder in cluster.encoders:
        encoder.failure = Failure(S.INTERNAL)
    reply = await post(cluster, {"messages": [image_message(png_data_url())]})
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error"
    assert sum(len(e.encodes) for e in cluster.encoders) == 2  # each encoder once
    assert cluster.pd.aborts


async def test_bad_input_at_the_encoder_is_not_retried(cluster_factory):
    cluster = await cluster_factory(num_encoders=2)
    for encoder in cluster.encoders:
        encoder.failure = Failure(S.INVALID_ARGUMENT)
    reply = await post(cluster, {"messages": [image_message(png_data_url())]})
    assert reply.status_code == 400
    assert sum(len(e.encodes) for e in cluster.encoders) == 1


async def test_a_pd_off_the_encoders_allow_list_is_a_500_without_retry_or_breaker_charge(cluster_factory):
    # Encoders are configured alike, so another would refuse too; the breakers stay closed: the
    # encoder serves every PD it may push to.
    cluster = await cluster_factory(num_encoders=2)
    for encoder in cluster.encoders:
        encoder.failure = Failure(S.PERMISSION_DENIED)
    for _ in range(cluster.app.state.proxy.config.breaker_failures):
        reply = await post(cluster, {"messages": [image_message(png_data_url())]})
        assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error"
    assert sum(len(e.encodes) for e in cluster.encoders) == cluster.app.state.proxy.config.breaker_failures
    assert all(instance(cluster, e.address).breaker.state is BreakerState.CLOSED for e in cluster.encoders)
    assert cluster.pd.aborts


async def test_encoder_cache_hits_are_reported(cluster_factory):
    cluster = await cluster_factory()
    url = png_data_url((1, 2, 3))
    first = await post(cluster, {"messages": [image_message(url)]})
    cluster.encoder.cache_hits.add(cluster.encoder.encodes[0].items[0].mm_hash)
    second = await post(cluster, {"messages": [image_message(url)]})
    assert first.json()["usage"]["epd"]["num_encoder_cache_hits"] == 0
    assert second.json()["usage"]["epd"]["num_encoder_cache_hits"] == 1
    metrics = (await cluster.client.get("/metrics")).text
    assert 'epd_proxy_image_sources_total{source="encoder_cache"} 1.0' in metrics


async def test_client_disconnect_cancels_outstanding_encodes(cluster_factory):
    cluster = await cluster_factory(http=True)
    cluster.encoder.delay_s = 30
    body = {"messages": [image_message(png_data_url(), png_data_url((0, 9, 0)))], "stream": True}

    async def consume() -> None:
        async with cluster.client.stream("POST", "/v1/chat/completions", json=body) as reply:
            async for _ in reply.aiter_bytes():
                pass

    task = asyncio.create_task(consume())
    await wait_until(lambda: len(cluster.encoder.encodes) == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: cluster.encoder.cancelled == 2 and cluster.pd.aborts)
    assert all(i.num_outstanding == 0 for i in [*backends(cluster).pds, *backends(cluster).encoders])


# --------------------------------------------------------------------------- deadlines


async def test_x_request_timeout_is_the_deadline_of_every_hop(cluster_factory):
    cluster = await cluster_factory(request_timeout_s=10.0)
    reply = await post(cluster, {"messages": [image_message(png_data_url())]}, headers={"X-Request-Timeout": "2.5"})
    assert reply.status_code == 200
    assert 1.5 < cluster.pd.deadlines[-1] <= 2.5 and 1.5 < cluster.encoder.deadlines[-1] <= 2.5
    await post(cluster, headers={"X-Request-Timeout": "3600"})  # may only shorten the server's limit
    # gRPC sends a timeout of 10 s or more in 100 ms units, rounded up: 10.0 can arrive as 10.1.
    assert cluster.pd.deadlines[-1] <= 10.1


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf", ""])
async def test_a_bad_x_request_timeout_is_400(cluster_factory, value):
    cluster = await cluster_factory()
    reply = await post(cluster, headers={"X-Request-Timeout": value})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request_timeout"
    assert cluster.pd.generates == []


async def test_a_short_x_request_timeout_is_504(cluster_factory):
    cluster = await cluster_factory()
    cluster.pd.hold_first_token.clear()
    reply = await post(cluster, headers={"X-Request-Timeout": "0.2"})
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout"
    await wait_until(lambda: cluster.pd.aborts)


# --------------------------------------------------------------------------- n, API key, DNS


async def test_n_choices_run_one_pd_request_each(cluster_factory):
    cluster = await cluster_factory()
    reply = await post(cluster, {**TEXT, "n": 3, "seed": 5, "temperature": 0.5})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello world!" for c in body["choices"])
    ids = sorted(g.request_id for g in cluster.pd.generates)
    assert ids == [body["id"], body["id"] + "-n1", body["id"] + "-n2"]  # fresh id per choice
    assert sorted(g.sampling.seed for g in cluster.pd.generates) == [5, 6, 7]
    assert body["usage"]["completion_tokens"] == 9 and body["usage"]["epd"]["num_choices"] == 3

    streamed = await post(cluster, {**TEXT, "n": 2, "stream": True})
    assert '"index":1' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    assert streamed.text.count('"finish_reason":"stop"') == 2


async def test_api_key_is_required_on_the_api_only(cluster_factory):
    cluster = await cluster_factory(api_key="k-123")
    missing = await post(cluster)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert (await post(cluster, headers={"Authorization": "Bearer wrong"})).status_code == 401
    assert (await cluster.client.get("/v1/models")).status_code == 401
    assert cluster.pd.generates == []
    assert (await post(cluster, headers={"Authorization": "Bearer k-123"})).status_code == 200
    assert (await cluster.client.get("/health")).status_code == 200


async def test_with_an_api_key_health_and_metrics_name_no_backend_to_strangers(cluster_factory):
    # Defect 10: /health listed every backend address and /metrics labelled them, to anyone.
    cluster = await cluster_factory(api_key="k-123")
    addresses = [cluster.pd.address, cluster.encoder.address]
    health = await cluster.client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    scrape = await cluster.client.get("/metrics")
    assert scrape.status_code == 401 and scrape.json()["error"]["code"] == "invalid_api_key"
    assert not any(address in health.text + scrape.text for address in addresses)
    assert (await cluster.client.get("/metrics", headers={"Authorization": "Bearer wrong"})).status_code == 401
    authorized = {"Authorization": "Bearer k-123"}
    full = (await cluster.client.get("/health", headers=authorized)).json()
    assert full["pd"] == {cluster.pd.address: True} and full["encoder"] == {cluster.encoder.address: True}
    scrape = await cluster.client.get("/metrics", headers=authorized)
    assert scrape.status_code == 200 and cluster.pd.address in scrape.text


async def test_internal_token_does_not_open_the_public_ports_metrics(cluster_factory):
    """Security review: the internal token (for calls between services) opened the public /metrics."""
    token = "internal-token-0123456789"
    bearer = {"Authorization": f"Bearer {token}"}
    cluster = await cluster_factory(security=InternalSecurity(token=token, metrics_auth=True))
    assert (await cluster.client.get("/metrics")).status_code == 401
    assert (await cluster.client.get("/metrics", headers=bearer)).status_code == 401
    assert "pd" not in (await cluster.client.get("/health", headers=bearer)).json()
    assert (await post(cluster)).status_code == 200  # the API itself stays open without --api-key
    keyed = await cluster_factory(api_key="k-123", security=InternalSecurity(token=token, metrics_auth=True))
    assert (await keyed.client.get("/metrics", headers=bearer)).status_code == 401
    assert (await keyed.client.get("/metrics", headers={"Authorization": "Bearer k-123"})).status_code == 200


async def test_the_scrape_port_takes_the_internal_token_and_the_public_port_has_no_metrics(cluster_factory):
    """Security review: ``--metrics-port`` is the documented way to scrape with the internal token."""
    token = "internal-token-0123456789"
    cluster = await cluster_factory(security=InternalSecurity(token=token, metrics_auth=True), metrics_port=0)
    assert (await post(cluster)).status_code == 200
    assert (await cluster.client.get("/metrics", headers={"Authorization": f"Bearer {token}"})).status_code == 404
    port = cluster.app.state.metrics_http.port
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as scraper:
        assert (await scraper.get("/metrics")).status_code == 401
        assert (await scraper.get("/metrics", headers={"Authorization": "Bearer k-123"})).status_code == 401
        scrape = await scraper.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert scrape.status_code == 200
    assert 'epd_proxy_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in scrape.text


async def test_the_scrape_port_is_closed_with_the_proxy(cluster_factory, tiny_model_dir):
    cluster = await cluster_factory()
    app = create_app(proxy_config(tiny_model_dir, cluster, metrics_port=0))
    async with app.router.lifespan_context(app):
        port = app.state.metrics_http.port
        async with httpx.AsyncClient(timeout=10) as scraper:
            assert (await scraper.get(f"http://127.0.0.1:{port}/metrics")).status_code == 200  # open without a token
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(timeout=2) as scraper:
            await scraper.get(f"http://127.0.0.1:{port}/metrics")


async def test_a_dns_name_with_two_addresses_is_two_instances_that_follow_dns(tiny_model_dir):
    pd_a, pd_b = FakePd(), FakePd()
    server_a = await serve_pd(pd_a, host="127.0.0.2")
    server_b = await serve_pd(pd_b, host="127.0.0.3", port=server_a.port)
    table = {"pd.test": ["127.0.0.2", "127.0.0.3"]}

    async def resolver(host: str, port: int) -> list[str]:
        return list(table[host])

    config = ProxyConfig(
        model=str(tiny_model_dir),
        pd_addresses=(f"pd.test:{server_a.port}",),
        encoder_addresses=(),
        request_timeout_s=10.0,
    )
    pool = connect_backends(config, resolver=resolver)
    app = create_app(config, backends=pool)
    lifespan = app.router.lifespan_context(app)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=10)
    try:
        await lifespan.__aenter__()
        assert sorted(p.address for p in pool.pds) == [pd_a.address, pd_b.address]
        for _ in range(4):
            assert (await client.post("/v1/chat/completions", json=TEXT)).status_code == 200
        assert pd_a.generates and pd_b.generates
        table["pd.test"] = ["127.0.0.3"]  # one replica went away
        await pool.pd_pool.refresh()
        before = len(pd_a.generates)
        for _ in range(4):
            assert (await client.post("/v1/chat/completions", json=TEXT)).status_code == 200
        assert len(pd_a.generates) == before
    finally:
        await client.aclose()
        await lifespan.__aexit__(None, None, None)
        await pool.close()
        await server_a.stop(0)
        await server_b.stop(0)

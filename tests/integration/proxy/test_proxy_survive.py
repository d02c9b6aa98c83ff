"""Proxy defects of issue 16 against test-double backends: breaker probes (5), push failures (9).

Each test fails on the code before the fix: a half-open probe held the
breaker for a whole generation, so a single-PD cluster answered 503 and its
``/health`` failed meanwhile; an encoder that could not push to one PD had
its own breaker opened for it.
"""

from __future__ import annotations

import asyncio

import grpc
from proxy_doubles import Failure, image_message, png_data_url, wait_until

from services.common import grpc_utils
from services.proxy.backends.instances import BreakerState

S = grpc.StatusCode
TEXT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


def _instance(cluster, address: str):
    proxy = cluster.app.state.proxy
    return next(i for i in [*proxy.backends.pds, *proxy.backends.encoders] if i.address == address)


async def _half_open_breaker(cluster, pd):
    """Opens ``pd``'s breaker with failed Generates, waits until it lets a probe through; returns the breaker."""
    breaker = _instance(cluster, pd.address).breaker
    pd.generate_failure = Failure(S.INTERNAL)
    while breaker.state is not BreakerState.OPEN:
        assert (await cluster.client.post("/v1/chat/completions", json=TEXT)).status_code == 500
    pd.generate_failure = None
    await wait_until(lambda: breaker.state is BreakerState.HALF_OPEN)
    return breaker


async def test_a_probe_settles_at_its_first_token_not_at_the_end_of_its_stream(cluster_factory):
    cluster = await cluster_factory(breaker_failures=2, breaker_open_s=0.2)
    pd = cluster.pd
    breaker = await _half_open_breaker(cluster, pd)
    pd.hold_after_first.clear()  # the probe streams its first token, then stalls
    probe = asyncio.create_task(cluster.client.post("/v1/chat/completions", json={**TEXT, "stream": True}))
    await wait_until(lambda: pd.num_active == 1 and breaker.state is BreakerState.CLOSED)
    health = await cluster.client.get("/health")
    assert health.status_code == 200 and health.json()["pd"][pd.address] is True
    other = asyncio.create_task(cluster.client.post("/v1/chat/completions", json=TEXT))
    await wait_until(lambda: len(pd.generates) == 4)  # 2 failures + the probe + this one: not refused
    pd.hold_after_first.set()
    assert (await other).status_code == 200 and (await probe).status_code == 200


async def test_a_single_pd_cluster_keeps_serving_while_a_probe_waits_for_its_first_token(cluster_factory):
    cluster = await cluster_factory(breaker_failures=2, breaker_open_s=0.2)
    pd = cluster.pd
    breaker = await _half_open_breaker(cluster, pd)
    pd.hold_first_token.clear()  # the probe gets no first token yet
    probe = asyncio.create_task(cluster.client.post("/v1/chat/completions", json=TEXT))
    await wait_until(lambda: pd.num_active == 1 and breaker.probing)
    health = await cluster.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    other = asyncio.create_task(cluster.client.post("/v1/chat/completions", json=TEXT))
    await wait_until(lambda: pd.num_active == 2)  # sent to the probing PD, not answered 503
    pd.hold_first_token.set()
    assert (await probe).status_code == 200 and (await other).status_code == 200
    assert breaker.state is BreakerState.CLOSED


async def test_push_failures_to_one_pd_are_charged_to_it_not_to_the_encoders(cluster_factory):
    cluster = await cluster_factory(num_pds=2, num_encoders=2, breaker_failures=2, pd_policy="round-robin")
    cut_off, reachable = cluster.pds
    for encoder in cluster.encoders:  # a partition between every encoder and one PD
        encoder.push_failures[cut_off.address] = Failure(S.UNAVAILABLE, failed_hop=grpc_utils.PUSH_HOP)
    statuses = []
    for shade in range(8):
        body = {"messages": [image_message(png_data_url((shade, 10, 20)))], "max_tokens": 2}
        statuses.append((await cluster.client.post("/v1/chat/completions", json=body)).status_code)
    assert statuses == [200] * 8  # each moved to the reachable PD
    for encoder in cluster.encoders:
        assert _instance(cluster, encoder.address).breaker.state is BreakerState.CLOSED
    assert _instance(cluster, cut_off.address).breaker.state is not BreakerState.CLOSED
    health = (await cluster.client.get("/health")).json()
    assert all(health["encoder"].values())
    assert len(reachable.generates) == 8 and cut_off.aborts  # the cut-off attempts were released


async def test_an_encoder_failing_on_its_own_is_still_charged(cluster_factory):
    cluster = await cluster_factory(num_encoders=1, breaker_failures=2)
    cluster.encoder.failure = Failure(S.INTERNAL)  # no failed-hop trailer: the encoder's own fault
    body = {"messages": [image_message(png_data_url())], "max_tokens": 2}
    for _ in range(2):
        assert (await cluster.client.post("/v1/chat/completions", json=body)).status_code == 500
    assert _instance(cluster, cluster.encoder.address).breaker.state is BreakerState.OPEN


async def test_an_encoder_that_stops_answering_is_charged_and_its_images_move_on(cluster_factory):
    """Security review, 9: a deadline never counted against an encoder, so one that hung took a share of
    the images until each request's own deadline ran out, and its breaker never opened."""
    cluster = await cluster_factory(num_encoders=2, breaker_failures=2, encode_timeout_s=0.3)
    hung, healthy = cluster.encoders
    hung.delay_s = 30.0  # takes the call, never answers in time
    statuses = []
    # Rendezvous hashing over the two (random) ports decides which images the hung encoder is
    # offered: send distinct images until it has taken two, its breaker's threshold (at most 32).
    for shade in range(32):
        if len(hung.encodes) >= 2:
            break
        body = {"messages": [image_message(png_data_url((shade, 40, 80)))], "max_tokens": 2}
        statuses.append((await cluster.client.post("/v1/chat/completions", json=body)).status_code)
    assert statuses == [200] * len(statuses)  # each image the hung encoder held moved to the healthy one
    assert len(healthy.encodes) == len(statuses) and len(hung.encodes) == 2 and hung.cancelled == 2
    assert _instance(cluster, hung.address).breaker.state is not BreakerState.CLOSED
    assert _instance(cluster, healthy.address).breaker.state is BreakerState.CLOSED
    registry = cluster.app.state.proxy.metrics.registry
    assert registry.get_sample_value("epd_proxy_stalls_total", {"kind": "encode"}) == len(hung.encodes)

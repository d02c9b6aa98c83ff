"""E+P+D through the proxy: the decode reservation's lease runs out before the prefill's push lands.

Real configuration, no test double: the proxy's ``--lease-ms`` is the lease it
asks ReserveKV for (docs, Routing and failure handling: "One deadline per request"), and the prefill PD
runs with ``--fault freeze-step-ms`` (its first client step stalls longer than
that lease). D's sweep frees the reservation and counts it
(``epd_pd_kv_reservations_expired_total{role="decode"}``); P's late push hears
DEADLINE_EXCEEDED, so the client gets 504 (``timeout``) as an OpenAI error
body, as for an image reservation whose lease ran out. Afterwards nothing is
left reserved, pending or referenced on E, P or D, and the next request is
token-exact.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from cluster_support import InProcessCluster
from oracle_support import user_message
from test_e2e_oracle import _chat

from services.pd.faults import NO_FAULTS, PdFaults

MAX_TOKENS = 16
LEASE_MS = 800  # the proxy's --lease-ms: what it asks D's ReserveKV for (room for a loaded CI host)
FREEZE_MS = 2500  # P's first client step stalls this long: its push comes after the lease
EXPIRED = 'epd_pd_kv_reservations_expired_total{role="decode"}'


@pytest.fixture
def cluster(tiny_model_dir):
    started = InProcessCluster(
        str(tiny_model_dir),
        num_pds=1,
        num_decodes=1,
        pd={"faults": PdFaults(freeze_step_ms=FREEZE_MS)},
        decode={"faults": NO_FAULTS, "metrics_port": 0},  # D: its default lease sweep
        proxy={"lease_ms": LEASE_MS},
    ).start()
    try:
        yield started
    finally:
        started.pds[0].engine.core.runner.thaw()  # a failed test must not leave the stop waiting on it
        started.stop()


def _expired(cluster: InProcessCluster) -> float:
    port = cluster.decodes[0].metrics_http.port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return next(float(line.split(" ")[1]) for line in text.splitlines() if line.startswith(EXPIRED + " "))


def test_a_reservation_that_expires_before_the_push_ends_in_504_and_leaves_nothing(cluster, client, oracle_for):
    assert _expired(cluster) == 0
    messages = [user_message("Tell me about leases. " * 8, [])]
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as failed:
        _chat(client, messages, False, max_tokens=MAX_TOKENS)
    assert time.monotonic() - began >= FREEZE_MS / 1000  # the push came after the freeze, past the lease
    assert failed.value.status_code == 504
    body = failed.value.body
    assert isinstance(body, dict) and body.get("message") and body.get("code") == "timeout", body
    assert cluster.pds[0].engine.core.runner.num_injected == 1  # the freeze was this request's prefill
    # D's sweep freed the reservation at its lease's end and counted it.
    deadline = time.monotonic() + 5
    while _expired(cluster) != 1:
        assert time.monotonic() < deadline, "the expired KV reservation was not counted"
        time.sleep(0.05)
    assert cluster.leaks() == {}, "something was left reserved, held, pending or referenced"
    counted = cluster.app.state.proxy.metrics.backend_requests
    assert counted.labels("pd", cluster.pd_addresses[0], "DEADLINE_EXCEEDED")._value.get() == 1
    # The cluster still serves (the freeze fired once): token-exact, through P and D.
    expected = oracle_for("tiny").generate(messages, [], MAX_TOKENS)
    assert _chat(client, messages, False, max_tokens=MAX_TOKENS)[0] == expected
    assert _chat(client, messages, True, max_tokens=MAX_TOKENS)[0] == expected
    assert _expired(cluster) == 1
    # the client fixture then checks every instance for leaks

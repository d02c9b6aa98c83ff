"""Faulty encoders, seen by an OpenAI client: a clean error, PD keeps serving, nobody else is affected.

One PD serves every request. Healthy traffic goes through the cluster's own
proxy and encoder; each fault kind gets its own encoder and its own proxy
(so the test does not depend on the proxy's routing policy). Faulty and
healthy requests run concurrently; the healthy ones must stay token-exact
against ``transformers`` ``generate()``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from cluster_support import InProcessCluster, encoder_config
from oracle_support import make_image, user_message
from test_e2e_handoff_support import MAX_TOKENS, ProxyOnly, chat, client_for

from services.encoder.faults import Faults
from services.encoder.server import start_encoder

# A request whose lease ends before its embedding arrives gets 504 from PD's lease
# sweep, or 500 when the sweep already removed the reservation before the
# proxy's Generate reached PD (a loaded machine, short test leases).
LEASE_ENDED = {500, 504}

# fault -> (encoder faults, proxy overrides, HTTP statuses the client may get)
FAULTS = {
    "wrong-shape": (Faults(wrong_shape=True), {}, {500}),
    "wrong-dtype": (Faults(wrong_dtype=True), {}, {500}),
    "extra-chunk": (Faults(extra_chunk=True), {}, {500}),
    # Pushes 1.5 s late against a 500 ms lease.
    "push-late": (Faults(push_late_ms=1500), {"lease_ms": 500}, LEASE_ENDED),
    "never-push": (Faults(never_push=True), {"lease_ms": 200}, LEASE_ENDED),
}
STUCK = Faults(push_late_ms=60_000)  # holds its push (and outbound bytes) for a minute


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model_dir = str(tiny_model_dir)
    cluster = InProcessCluster(model_dir, pd={"lease_sweep_interval_s": 0.05}).start()
    vision = cluster.encoders[0].vision
    proxies = {}
    try:
        for name, (faults, proxy, _) in [*FAULTS.items(), ("stuck", (STUCK, {}, None))]:
            config = encoder_config(model_dir, port=0, metrics_port=-1, faults=faults, grace_s=0)
            encoder = cluster.run(start_encoder(config, vision=vision))
            cluster.encoders.append(encoder)  # leak checks and stop() cover it
            proxies[name] = ProxyOnly(model_dir, cluster.pd_addresses, [encoder.address], **proxy).start()
        yield cluster, proxies
    finally:
        for proxy in proxies.values():
            proxy.stop()
        cluster.stop()


def _status_of(client: openai.OpenAI, messages: list[dict]) -> int:
    try:
        chat(client, messages)
    except openai.APIStatusError as error:
        assert error.body and "message" in error.body, "not an OpenAI error body"
        return error.status_code
    return 200


def test_faulty_pushes_fail_cleanly_while_other_requests_stay_exact(setup, oracle) -> None:
    cluster, proxies = setup
    healthy_cases = [
        ("Describe the picture.", [make_image(300)]),
        ("Compare these.", [make_image(301), make_image(302, (30, 60)), make_image(303)]),
        ("Just text, please.", []),
        ("Another picture.", [make_image(304, (64, 64))]),
    ]
    healthy = [[user_message(text, images)] for text, images in healthy_cases]
    expected = [oracle.generate(m, images, MAX_TOKENS) for m, (_, images) in zip(healthy, healthy_cases)]
    faulty = [(name, [user_message(f"Fault {name}.", [make_image(400 + i)])]) for i, name in enumerate(FAULTS)]
    good_client = client_for(cluster)
    fault_clients = {name: client_for(proxy, timeout=30) for name, proxy in proxies.items()}
    with ThreadPoolExecutor(len(healthy) + len(faulty)) as pool:
        bad_futures = {name: pool.submit(_status_of, fault_clients[name], m) for name, m in faulty}
        good_futures = [pool.submit(chat, good_client, m) for m in healthy]
        statuses = {name: future.result() for name, future in bad_futures.items()}
        outputs = [future.result()[0] for future in good_futures]
    for name, (_, _, allowed) in FAULTS.items():
        assert statuses[name] in allowed, name
    assert outputs == expected
    # PD keeps serving after every rejection.
    assert chat(good_client, healthy[0])[0] == expected[0]
    assert cluster.leaks() == {}


def test_never_pushing_encoder_200_times_leaks_nothing(setup) -> None:
    cluster, proxies = setup
    client = client_for(proxies["never-push"], timeout=30)
    batch, total = 25, 200
    watched = ("num_entries", "num_reservations", "used_tokens", "num_embeddings_stored", "num_live_requests")

    def footprint() -> dict[str, int]:
        stats = cluster.run(cluster.pds[0].stats())
        return {key: getattr(stats, key) for key in watched}

    before = footprint()
    statuses = []
    with ThreadPoolExecutor(batch) as pool:
        for start in range(0, total, batch):
            messages = [[user_message("Never pushed.", [make_image(1000 + i)])] for i in range(start, start + batch)]
            statuses += list(pool.map(lambda m: _status_of(client, m), messages))
            assert cluster.leaks() == {}
    assert set(statuses) <= LEASE_ENDED and 504 in statuses
    assert footprint() == before
    assert all(encoder.stats().num_pending == 0 for encoder in cluster.encoders)


def test_client_disconnect_releases_the_reservation_and_stops_the_push(setup) -> None:
    cluster, proxies = setup
    client = client_for(proxies["stuck"], timeout=1.0)  # gives up long before the stuck push
    with pytest.raises(openai.APITimeoutError):
        chat(client, [user_message("Hanging up.", [make_image(2000)])])
    # A push still waiting would hold its outbound bytes for a minute, and an
    # un-aborted request its PD reservation for the 30 s lease.
    assert cluster.leaks() == {}

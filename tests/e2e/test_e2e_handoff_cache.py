"""A repeated image is encoded once: PD cache hits, encoder cache hits, and single flight.

Two PDs share one encoder; proxy A serves PD 0 and proxy B serves PD 1, so a
test decides which PD sees a request (PD's embedding cache is per PD, the
encoder's is shared).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_support import InProcessCluster
from oracle_support import Oracle, make_image, user_message
from test_e2e_handoff_support import MAX_TOKENS, chat, client_for, proxy_per_pd


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    with proxy_per_pd(str(tiny_model_dir)) as made:
        yield made


@pytest.fixture
def clients(setup):
    cluster, proxies = setup
    yield [client_for(proxy) for proxy in proxies]
    assert cluster.leaks() == {}


def _num_encoded(cluster: InProcessCluster) -> int:
    return cluster.encoders[0].stats().num_images_encoded


def test_repeated_image_is_a_pd_hit_then_an_encoder_hit(setup, clients, tiny_model_dir) -> None:
    cluster, _ = setup
    image = make_image(500)
    messages = [user_message("What is this?", [image])]
    expected = Oracle(str(tiny_model_dir)).generate(messages, [image], MAX_TOKENS)
    start = _num_encoded(cluster)

    first, first_usage = chat(clients[0], messages)
    assert (first_usage["num_images_ready"], first_usage["num_encoder_cache_hits"]) == (0, 0)
    assert _num_encoded(cluster) == start + 1

    again, again_usage = chat(clients[0], messages)  # same PD: its embedding cache has it
    assert (again_usage["num_images_ready"], again_usage["num_encoder_cache_hits"]) == (1, 0)

    other, other_usage = chat(clients[1], messages)  # the other PD: the encoder's cache has it
    assert (other_usage["num_images_ready"], other_usage["num_encoder_cache_hits"]) == (0, 1)

    assert _num_encoded(cluster) == start + 1
    assert first == again == other == expected


def test_concurrent_requests_for_one_new_image_run_the_vit_once(setup, clients) -> None:
    cluster, _ = setup
    messages = [user_message("All at once.", [make_image(501, (56, 40))])]
    start = _num_encoded(cluster)
    with ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(lambda _: chat(clients[0], messages)[0], range(6)))
    assert _num_encoded(cluster) == start + 1
    assert all(output == outputs[0] for output in outputs)

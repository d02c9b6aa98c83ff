"""Colocated mode (PD encodes in its own step loop) gives the same greedy tokens as disaggregated mode.

Both clusters serve the same concurrent requests (text only, one image,
three images); both must equal ``transformers`` ``generate()``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_support import InProcessCluster
from oracle_support import make_image, user_message
from test_e2e_handoff_support import MAX_TOKENS, chat, client_for

from services.common import grpc_utils


class ColocatedCluster(InProcessCluster):
    """One PD started with ``encoder="local"``; the proxy's encoder is the PD itself."""

    def __init__(self, model_dir: str) -> None:
        super().__init__(model_dir, num_encoders=0, pd={"encoder": "local"})

    @property
    def encoder_addresses(self) -> list[str]:
        return self.pd_addresses


@pytest.fixture(scope="module")
def clusters(tiny_model_dir):
    started = []
    try:
        started.append(InProcessCluster(str(tiny_model_dir)).start())
        started.append(ColocatedCluster(str(tiny_model_dir)).start())
        yield started
    finally:
        for cluster in started:
            cluster.stop()


CASES = [
    ("Tell me about cats.", []),
    ("What is in this picture?", [make_image(600)]),
    ("Compare these pictures.", [make_image(601), make_image(602, (64, 30)), make_image(603, (20, 50))]),
    ("And this one?", [make_image(604, (40, 40))]),
]


def test_colocated_and_disaggregated_tokens_are_identical(clusters, oracle) -> None:
    messages = [[user_message(text, images)] for text, images in CASES]
    expected = [oracle.generate(m, images, MAX_TOKENS) for m, (_, images) in zip(messages, CASES)]
    results = []
    for cluster in clusters:
        client = client_for(cluster)
        with ThreadPoolExecutor(len(messages)) as pool:
            results.append([reply[0] for reply in pool.map(chat, [client] * len(messages), messages)])
        assert cluster.leaks() == {}
    disaggregated, colocated = results
    assert colocated == disaggregated == expected


def test_colocated_pd_serves_the_encoder_service(clusters) -> None:
    colocated = clusters[1]
    pd = colocated.pds[0]
    assert pd.colocated is not None and clusters[0].pds[0].colocated is None
    address = colocated.pd_addresses[0]
    assert colocated.run(grpc_utils.check_health(address, "epd.v1.Encoder"))
    assert colocated.run(grpc_utils.check_health(address, "epd.v1.PrefillDecode"))


def test_colocated_encodes_a_repeated_image_once(clusters) -> None:
    colocated = clusters[1]
    encoder = colocated.pds[0].colocated.encoder
    client = client_for(colocated)
    messages = [user_message("Same picture, many times.", [make_image(605, (50, 30))])]
    start = encoder.num_images_encoded
    with ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(lambda _: chat(client, messages)[0], range(6)))
    assert encoder.num_images_encoded == start + 1
    assert all(output == outputs[0] for output in outputs)
    _, usage = chat(client, messages)
    assert usage["num_images_ready"] == 1  # PD's embedding cache is the colocated engine's cache
    assert colocated.leaks() == {}

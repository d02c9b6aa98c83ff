"""Security review, the cross-user side channel: per-tenant cache salts.

Caches keyed by content alone answered a repeated image or prompt faster,
whoever had sent it first. Under ``--cache-isolation per-client`` two
clients (peer addresses 127.0.0.1 and 127.0.0.2) sending the same image and
prompt get no hits from each other, neither from PD (embedding cache,
prefix cache) nor from the encoder, while each still hits its own; a
``cache_salt`` splits one client further. Greedy output is the oracle's
throughout. Two proxies, one per PD, share one encoder, so a test decides
which PD sees a request (as in ``test_e2e_handoff_cache``).
"""

from __future__ import annotations

import httpx
import openai
import pytest
from cluster_support import InProcessCluster
from oracle_support import Oracle, make_image, user_message
from test_e2e_handoff_support import MAX_TOKENS, proxy_per_pd

from services.proxy.cache_isolation import CacheIsolation

TENANTS = ("127.0.0.1", "127.0.0.2")


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    with proxy_per_pd(str(tiny_model_dir), cache_isolation=CacheIsolation.PER_CLIENT) as made:
        yield made


@pytest.fixture
def clients(setup):
    """``clients[proxy][tenant]``: each tenant's own client (its own source address) of each proxy."""
    cluster, proxies = setup
    made = [[_client(proxy, tenant) for tenant in TENANTS] for proxy in proxies]
    yield made
    for row in made:
        for client in row:
            client.close()
    assert cluster.leaks() == {}


def _client(proxy: InProcessCluster, source: str) -> openai.OpenAI:
    transport = httpx.HTTPTransport(local_address=source)
    http = httpx.Client(transport=transport, timeout=120)
    return openai.OpenAI(base_url=proxy.base_url, api_key="unused", max_retries=0, http_client=http)


def _chat(client: openai.OpenAI, messages: list[dict], **extra) -> tuple[list[int], tuple[int, int, int]]:
    """Greedy: (token ids, (images ready on PD, encoder cache hits, cached prompt tokens))."""
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )
    epd = reply.usage.model_extra["epd"]
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    return reply.choices[0].model_extra["token_ids"], (epd["num_images_ready"], epd["num_encoder_cache_hits"], cached)


def _num_encoded(cluster: InProcessCluster) -> int:
    return cluster.encoders[0].stats().num_images_encoded


def test_tenants_get_no_cache_hits_from_each_other_and_the_same_tenant_does(setup, clients, tiny_model_dir):
    cluster, _ = setup
    image = make_image(600)
    messages = [user_message("Describe this picture in a few words, please.", [image])]
    expected = Oracle(str(tiny_model_dir)).generate(messages, [image], MAX_TOKENS)
    (alice, bob), (_, bob_elsewhere) = clients
    start = _num_encoded(cluster)

    first, first_usage = _chat(alice, messages)
    assert first_usage == (0, 0, 0) and _num_encoded(cluster) == start + 1

    # Bob, same image and prompt on the same PD: nothing of Alice's is served to him.
    other, other_usage = _chat(bob, messages)
    assert other_usage == (0, 0, 0)
    assert _num_encoded(cluster) == start + 2  # the encoder ran the ViT again, for Bob's own entry

    # Alice again: her image is on PD and her prompt's blocks are in the prefix cache.
    again, again_usage = _chat(alice, messages)
    assert again_usage[0] == 1 and again_usage[2] > 0

    # Bob through the other PD: the encoder's cache has his own entry.
    elsewhere, elsewhere_usage = _chat(bob_elsewhere, messages)
    assert elsewhere_usage == (0, 1, 0) and _num_encoded(cluster) == start + 2

    # A cache_salt splits Alice from herself: nothing cached is hers under it.
    salted, salted_usage = _chat(alice, messages, cache_salt="project-b")
    assert salted_usage == (0, 0, 0) and _num_encoded(cluster) == start + 3

    assert first == other == again == elsewhere == salted == expected


def test_text_prompts_share_the_prefix_cache_only_within_a_tenant(clients):
    (alice, bob), _ = clients
    prompt = "The quick brown fox jumps over the lazy dog. " * 6

    def cached_tokens(client: openai.OpenAI) -> tuple[str, int]:
        reply = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=4, temperature=0
        )
        return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens or 0

    first, bob_first, again = cached_tokens(alice), cached_tokens(bob), cached_tokens(alice)
    assert first[1] == 0 and bob_first[1] == 0 and again[1] > 0
    assert first[0] == bob_first[0] == again[0]

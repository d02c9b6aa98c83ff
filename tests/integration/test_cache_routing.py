"""Cache-aware routing over real PDs (tiny model): a conversation's next turn goes where its prefix and image
are; no encoder call for an image that PD holds; a PD that leaves takes its index entries with it, and the
conversation goes on elsewhere. E+P+D: the prefill instance is chosen the same way."""

from __future__ import annotations

import time

import openai
import pytest
from cluster_support import InProcessCluster
from oracle_support import make_image, user_message

MAX_TOKENS = 6
SYSTEM = "You are a careful assistant. " * 12  # a long shared prefix, as chat applications send


def _index(cluster: InProcessCluster):
    return cluster.app.state.proxy.backends.monitor.cache_index


def _held(pd) -> int:
    """Blocks and READY embeddings the PD's caches hold (what its events announced)."""
    core = pd.engine.core
    return core.kv_cache.num_cached_blocks + len(core.embedding_cache.ready_entries())


def wait_synced(cluster: InProcessCluster, pds, timeout: float = 10.0) -> None:
    """Until the proxy's index holds exactly what each PD's caches hold (their events have arrived)."""
    index = _index(cluster)
    deadline = time.monotonic() + timeout
    while True:
        sizes = index.sizes()
        wanted = {f"127.0.0.1:{pd.port}": _held(pd) for pd in pds}
        if all(sizes.get(address) == count for address, count in wanted.items()):
            return
        assert time.monotonic() < deadline, (sizes, wanted)
        time.sleep(0.02)


def encode_calls(cluster: InProcessCluster) -> float:
    registry = cluster.app.state.proxy.metrics.registry
    return sum(
        registry.get_sample_value(
            "epd_proxy_backend_requests_total", {"kind": "encoder", "address": address, "status": "OK"}
        )
        or 0.0
        for address in cluster.encoder_addresses
    )


class Conversation:
    """A system prompt, an image in the first user turn, then follow-ups resending the whole history (the
    answers included), as chat clients do."""

    def __init__(self, cluster: InProcessCluster, client: openai.OpenAI, model: str, seed: int) -> None:
        self.cluster, self.client, self.model = cluster, client, model
        self.messages = [
            {"role": "system", "content": f"{SYSTEM} Conversation {seed}."},
            user_message("Describe the picture.", [make_image(seed, (48, 40))]),
        ]
        self.usages: list = []

    def turn(self):
        """Sends the next turn; returns its usage once every PD's events about it reached the proxy."""
        reply = self.client.chat.completions.create(
            model=self.model, messages=self.messages, max_tokens=MAX_TOKENS, temperature=0
        )
        self.usages.append(reply.usage)
        self.messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"And what else, part {len(self.usages)}?"},
        ]
        wait_synced(self.cluster, self.cluster.pds + self.cluster.decodes)
        return reply.usage

    def turns(self, count: int) -> list:
        return [self.turn() for _ in range(count)]


def assert_stayed(usages) -> None:
    """Each follow-up found its whole previous turn (but its last, partial block) cached: the same PD."""
    for previous, usage in zip(usages, usages[1:]):
        assert usage.prompt_tokens_details.cached_tokens >= previous.prompt_tokens - 16
        assert usage.model_extra["epd"]["num_images_ready"] == 1  # the image was not sent to an encoder


def decisions(cluster: InProcessCluster, reason: str) -> float:
    registry = cluster.app.state.proxy.metrics.registry
    return registry.get_sample_value("epd_proxy_pd_route_decisions_total", {"reason": reason}) or 0.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    started = InProcessCluster(
        str(tiny_model_dir), num_encoders=1, num_pds=2, proxy={"load_poll_s": 0.05, "pd_policy": "cache-aware"}
    ).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def client(cluster):
    with openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client
    assert cluster.leaks() == {}


def test_every_follow_up_goes_where_its_conversation_is(cluster, client):
    model = client.models.list().data[0].id
    assert cluster.app.state.proxy.config.pd_policy == "cache-aware"
    wait_synced(cluster, cluster.pds)
    for seed in (1, 2, 3, 4):
        encodes_before = encode_calls(cluster)
        assert_stayed(Conversation(cluster, client, model, seed).turns(4))
        assert encode_calls(cluster) == encodes_before + 1  # only the first turn's image was encoded
    sizes = _index(cluster).sizes()
    assert sorted(sizes) == sorted(cluster.pd_addresses) and all(sizes.values())
    registry = cluster.app.state.proxy.metrics.registry
    assert decisions(cluster, "cache") >= 12
    assert registry.get_sample_value("epd_proxy_pd_route_hit_tokens_total") > 0
    assert registry.get_sample_value("epd_proxy_cache_event_lag_seconds_count") > 0
    # The answered turns count as work that comes back to their PDs (a new conversation's placement).
    assert sum(pd.returning_tokens() for pd in cluster.app.state.proxy.backends.pds) > 0


def test_load_outweighs_the_cache_and_the_conversation_then_stays_where_it_went(cluster, client):
    """A new conversation whose system prompt one PD holds goes to the other when the first is loaded
    enough; its follow-ups then stay there, where its own prefix and image are."""
    model = client.models.list().data[0].id
    pds = cluster.app.state.proxy.backends.pds
    busy = max(pds, key=lambda pd: _index(cluster).sizes().get(pd.address, 0))  # holds the system prompt

    async def load(num_tokens: int) -> None:  # on the proxy's loop, where its calls count their tokens
        busy.hold_tokens(num_tokens)

    conversation = Conversation(cluster, client, model, seed=40)
    moved_before = decisions(cluster, "load_over_cache") + decisions(cluster, "load")
    cluster.run(load(100_000))  # far beyond the weight times the system prompt's tokens
    try:
        conversation.turn()
    finally:
        cluster.run(load(-100_000))
    assert decisions(cluster, "load_over_cache") + decisions(cluster, "load") == moved_before + 1
    conversation.turns(2)
    assert_stayed(conversation.usages)


def test_a_pd_that_leaves_takes_its_entries_and_its_conversations_go_on(tiny_model_dir):
    cluster = InProcessCluster(
        str(tiny_model_dir), num_encoders=1, num_pds=2, proxy={"load_poll_s": 0.05, "pd_policy": "cache-aware"}
    ).start()
    try:
        with openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            wait_synced(cluster, cluster.pds)
            index = _index(cluster)
            left = {}

            def stop_the_conversations_pd() -> None:
                holder = max(cluster.pds, key=_held)  # it served turns 0 and 1
                address = f"127.0.0.1:{holder.port}"
                assert index.sizes()[address] > 0
                cluster.run(holder.stop(0))
                stopped = time.monotonic()
                while address in index.sizes():
                    assert time.monotonic() - stopped < 1.0, "its entries outlived it"
                    time.sleep(0.01)
                left["address"] = address
                cluster.pds.remove(holder)

            conversation = Conversation(cluster, client, model, seed=20)
            usages = conversation.turns(2)
            stop_the_conversations_pd()
            usages += conversation.turns(2)
            assert usages[1].prompt_tokens_details.cached_tokens > 0
            assert usages[2].model_extra["epd"]["num_images_ready"] == 0  # re-encoded for the surviving PD
            assert usages[3].prompt_tokens_details.cached_tokens >= usages[2].prompt_tokens - 16
            assert left["address"] not in index.sizes()
    finally:
        cluster.stop()


def test_epd_chooses_the_prefill_instance_by_cache_too(tiny_model_dir):
    cluster = InProcessCluster(
        str(tiny_model_dir),
        num_encoders=1,
        num_pds=2,
        num_decodes=1,
        proxy={"load_poll_s": 0.05, "pd_policy": "cache-aware"},
    ).start()
    try:
        with openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            wait_synced(cluster, cluster.pds + cluster.decodes)
            for seed in (30, 31):
                encodes_before = encode_calls(cluster)
                assert_stayed(Conversation(cluster, client, model, seed).turns(3))
                assert encode_calls(cluster) == encodes_before + 1
            assert sorted(_index(cluster).sizes()) == sorted(cluster.pd_addresses + cluster.decode_addresses)
        assert cluster.leaks() == {}
    finally:
        cluster.stop()

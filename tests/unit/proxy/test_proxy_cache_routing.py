"""The cache-aware PD policy (services/proxy/backends/routing.py): cost = weight x tokens to compute + load."""

from __future__ import annotations

import pytest

from services.common.pb import epd_pb2
from services.proxy.backends.cache_index import CacheIndex, PromptImage, RouteDecision, RoutedPrompt
from services.proxy.backends.instances import RETURNING_HALF_LIFE_S, CircuitBreaker, PdClient
from services.proxy.backends.routing import CacheAwarePdPolicy, make_pd_policy
from services.proxy.dispatch.jobs import Job
from services.proxy.prompt.preprocess import ImageItem, Prompt

BS = 16


class FakeChannel:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class FakeClock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def pds(n: int, clock=None) -> list[PdClient]:
    clock = clock or FakeClock()
    return [PdClient(f"pd{i}:1", FakeChannel(), breaker=CircuitBreaker(clock=clock), clock=clock) for i in range(n)]


def conversation(turn: int) -> RoutedPrompt:
    """A system prompt, an image and ``turn`` more exchanges of 40 tokens: each turn extends the last."""
    tokens = list(range(1, 201)) + [9] * 64 + [1000 + i for i in range(40 * turn + 10)]
    return RoutedPrompt(tokens, (PromptImage("e" * 64, 200, 64),))


def holding(index: CacheIndex, address: str, prompt: RoutedPrompt, *, embedding: bool = False) -> None:
    """``address``'s PD announces the blocks of ``prompt`` (and the image's embedding)."""
    index.begin(address)
    embeddings = [epd_pb2.CachedEmbedding(mm_hash=i.mm_hash, num_tokens=i.num_tokens) for i in prompt.images]
    index.apply(
        address,
        epd_pb2.CacheEvents(
            instance_id="boot",
            block_size=BS,
            sequence=1,
            snapshot=True,
            blocks_stored=prompt.keys(BS),
            embeddings_stored=embeddings if embedding else [],
        ),
    )


def firsts(policy, instances, prompt, n=4) -> list[str]:
    return [policy.rank(instances, prompt)[0].address for _ in range(n)]


def test_a_follow_up_goes_where_its_conversation_is_cached():
    index = CacheIndex()
    instances = pds(3)
    policy = CacheAwarePdPolicy(index, cache_weight=2.0)
    holding(index, "pd1:1", conversation(1))
    holding(index, "pd2:1", conversation(0))  # only the first turn
    follow_up = conversation(2)
    assert firsts(policy, instances, follow_up) == ["pd1:1"] * 4
    decision = follow_up.decision
    assert decision == RouteDecision("pd1:1", "cache", 304, 304, 0)  # 19 blocks of the previous turn's 314 tokens
    # Without a prompt (or anything cached) the order is by load; ties rotate.
    instances[0].hold_tokens(500)
    assert set(firsts(policy, instances, None)) == {"pd1:1", "pd2:1"}
    fresh = RoutedPrompt(list(range(5000, 5100)))
    assert set(firsts(policy, instances, fresh)) == {"pd1:1", "pd2:1"}
    assert fresh.decision is not None and fresh.decision.reason == "load"


def test_load_outweighs_the_cache_past_the_weight():
    index = CacheIndex()
    instances = pds(2)
    holding(index, "pd0:1", conversation(1))
    follow_up = conversation(2)  # 354 tokens; pd0 holds 304 of them, pd1 none: 304 more to compute on pd1
    policy = CacheAwarePdPolicy(index, cache_weight=2.0)
    instances[0].hold_tokens(600)  # below 2 x 304 more load than pd1: stay
    assert policy.rank(instances, follow_up)[0].address == "pd0:1"
    instances[0].hold_tokens(20)  # 620 > 608: the conversation moves
    assert policy.rank(instances, follow_up)[0].address == "pd1:1"
    assert follow_up.decision == RouteDecision("pd1:1", "load_over_cache", 0, 304, 0)
    # A larger weight keeps it; weight 0 is token load alone.
    assert CacheAwarePdPolicy(index, cache_weight=4.0).rank(instances, follow_up)[0].address == "pd0:1"
    instances[0].release_tokens(615)
    assert CacheAwarePdPolicy(index, cache_weight=0.0).rank(instances, follow_up)[0].address == "pd1:1"
    with pytest.raises(ValueError):
        CacheAwarePdPolicy(index, cache_weight=-1)


def test_load_is_in_tokens_ours_now_and_the_others_from_get_load():
    instances = pds(2)
    pd = instances[0]
    pd.hold_tokens(300)
    pd.set_load(epd_pb2.PdLoad(num_running_tokens=800, num_waiting_tokens=200))  # 300 of it ours
    assert pd.estimated_tokens() == 1000
    pd.hold_tokens(50)  # ours since the poll add up on top
    pd.release_tokens(300)
    assert pd.estimated_tokens() == 50 + 700
    assert instances[1].estimated_tokens() == 0  # nothing reported yet


def test_held_embeddings_count_past_the_cached_prefix_and_busy_pds_go_last():
    index = CacheIndex()
    clock = FakeClock()
    instances = pds(2, clock)
    prompt = conversation(0)
    index.begin("pd1:1")
    index.apply(
        "pd1:1",
        epd_pb2.CacheEvents(
            instance_id="b",
            block_size=BS,
            sequence=1,
            snapshot=True,
            blocks_stored=prompt.keys(BS)[:12],  # the system prompt (192 tokens), not the image's blocks
            embeddings_stored=[epd_pb2.CachedEmbedding(mm_hash="e" * 64, num_tokens=64)],
        ),
    )
    holding(index, "pd0:1", RoutedPrompt(prompt.token_ids[:200]))  # the same system prompt alone
    policy = CacheAwarePdPolicy(index)
    assert policy.rank(instances, prompt)[0].address == "pd1:1"  # 192 + the image's 64 tokens, no encode
    assert prompt.decision is not None and prompt.decision.hit_tokens == 256 and prompt.decision.best_hit_tokens == 256
    instances[1].mark_busy(1.0)
    assert policy.rank(instances, prompt)[0].address == "pd0:1"
    assert prompt.decision is not None and prompt.decision.reason == "load_over_cache"


def test_the_policy_is_built_by_name_and_a_job_routes_its_prompt():
    index = CacheIndex()
    policy = make_pd_policy("cache-aware", cache_index=index, cache_weight=3.0)
    assert isinstance(policy, CacheAwarePdPolicy) and policy.index is index and policy.cache_weight == 3.0
    assert isinstance(make_pd_policy("cache-aware"), CacheAwarePdPolicy)
    image = ImageItem("c" * 64, offset=2, num_tokens=4, image_file=b"", token_grid=(1, 2, 2))
    job = Job("r", Prompt([5] * 40, (image,), "ab" * 32), epd_pb2.SamplingParams(), deadline=1e9)
    route = job.route
    assert route is job.route  # built once per job
    assert route.images == (PromptImage("c" * 64, 2, 4, (1, 2, 2)),) and route.cache_salt == "ab" * 32
    assert len(route.keys(BS)) == 2


def test_a_new_conversation_counts_the_work_that_comes_back_to_each_pd():
    index = CacheIndex()
    clock = FakeClock()
    instances = pds(2, clock)
    policy = CacheAwarePdPolicy(index, cache_weight=2.0)
    # pd0 answered a turn a moment ago (its user is thinking); pd1 serves a call now.
    instances[0].hold_tokens(500)
    instances[0].release_tokens(500, finished=True)
    instances[1].hold_tokens(300)
    new = RoutedPrompt(list(range(5000, 5100)))
    assert firsts(policy, instances, new) == ["pd1:1"] * 4  # 300 in flight < 500 coming back
    assert new.decision == RouteDecision("pd1:1", "load", 0, 0, 300)
    clock.now += RETURNING_HALF_LIFE_S  # half of it is forgotten: 250 < 300
    assert instances[0].returning_tokens() == pytest.approx(250)
    assert firsts(policy, instances, new) == ["pd0:1"] * 4
    # A call that failed or was cancelled is not a conversation that comes back.
    instances[1].hold_tokens(1000)
    instances[1].release_tokens(1000)
    assert instances[1].returning_tokens() == 0
    # A follow-up goes by its cache as before: pd0's returning work is not held against it.
    clock.now -= RETURNING_HALF_LIFE_S
    holding(index, "pd0:1", conversation(1))
    follow_up = conversation(2)
    assert firsts(policy, instances, follow_up) == ["pd0:1"] * 4
    assert follow_up.decision == RouteDecision("pd0:1", "cache", 304, 304, 0)

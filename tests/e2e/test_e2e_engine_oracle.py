"""The engine under pressure still equals transformers generate(), token for token.

Each scenario runs its own cluster (proxy -> encoder -> PD) with PD settings
that force one engine mechanism: 32 concurrent mixed requests, chunked
prefill with a 16-token step budget (prompts and image spans split across
steps), an inter-token latency target that holds prefill to 5-token chunks
while anything decodes, a KV pool barely larger than one request (recompute
preemption), and prefix-cache hits on a repeated long prompt, with and
without an image. Every other scenario runs the default adaptive step
budget. The oracle is the full checkpoint's ``generate()`` (greedy); requests
go through the official ``openai`` client. The pressure cases also run on
Qwen2.5-VL, whose image tokens carry 3-D rotary positions that every
mechanism must keep.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from cluster_support import InProcessCluster
from oracle_support import Oracle, make_image, user_message

from services.pd.engine.engine_stats import EngineStats

MAX_TOKENS = 16
LONG_TEXT = " ".join(f"Fact {i}: the quick brown fox number {i} jumps over lazy dog {i * 7}." for i in range(12))


QWEN = "qwen2.5-vl-tiny"
# Image side scale per model: Qwen's images get as many tokens as their pixels
# give, so they are drawn larger to make spans that a 16-token step must split.
SCALE = {"tiny": 1, QWEN: 2}


@pytest.fixture
def model():
    """The preset under test (parametrized indirectly; LLaVA's tiny by default)."""
    return "tiny"


@pytest.fixture
def oracle(model, oracle_for):
    return oracle_for(model)


@pytest.fixture
def start_cluster(build_model, model):
    """Starts a cluster with PD overrides (and ``encoder``'s); stops it (after a leak check) when the test ends."""
    started: list[InProcessCluster] = []

    def start(encoder: dict | None = None, **pd_overrides) -> InProcessCluster:
        started.append(InProcessCluster(str(build_model(model)), pd=pd_overrides, encoder=encoder).start())
        return started[-1]

    yield start
    for cluster in started:
        try:
            assert cluster.leaks() == {}, "something was left reserved, pending or referenced"
        finally:
            cluster.stop()


def _chat(cluster: InProcessCluster, messages: list[dict]):
    """One greedy, non-streaming chat completion: (token ids, usage)."""
    with openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=300) as client:
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
    return reply.choices[0].model_extra["token_ids"], reply.usage


def _pd_stats(cluster: InProcessCluster) -> EngineStats:
    return cluster.run(cluster.pds[0].stats())


def _mixed_requests(count: int, scale: int = 1) -> list[tuple[list[dict], list]]:
    """Requests with 0, 1 or 2 images drawn from a small pool (so some images repeat)."""
    requests = []
    for i in range(count):
        images = [make_image(500 + (i * 3 + k) % 7, ((32 + 8 * k) * scale, 40 * scale)) for k in range(i % 3)]
        text = f"Request {i}: describe what you see in detail." + (" Be brief." if i % 2 else "")
        requests.append(([user_message(text, images)], images))
    return requests


def _check_concurrently(cluster, oracle, requests) -> None:
    expected = [oracle.generate(messages, images, MAX_TOKENS) for messages, images in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: _chat(cluster, r[0])[0], requests))
    for i, (want, got) in enumerate(zip(expected, results)):
        assert got == want, f"request {i} differs from generate()"


def test_32_concurrent_mixed_requests(start_cluster, oracle):
    cluster = start_cluster()
    _check_concurrently(cluster, oracle, _mixed_requests(32))


@pytest.mark.parametrize("model", ["tiny", QWEN], indirect=True)
def test_chunked_prefill_with_a_16_token_step_budget(start_cluster, oracle, model):
    cluster = start_cluster(max_num_batched_tokens=16)
    requests = _mixed_requests(6, SCALE[model])
    _check_concurrently(cluster, oracle, requests)
    # Every prompt (>= 16 image rows plus the template) needed several steps.
    assert _pd_stats(cluster).num_steps >= sum(1 for _ in requests) * 2


def test_an_itl_target_squeezes_prefill_to_odd_chunks_while_others_decode(start_cluster, oracle):
    # A target no step can meet: while anything decodes, every prefill chunk is the
    # 5-token minimum, so prompts and image spans split at boundaries no block shares.
    cluster = start_cluster(slo_itl_ms=0.001, min_prefill_tokens=5)
    held_back = _pd_stats(cluster).budget.num_limited_steps
    _check_concurrently(cluster, oracle, _mixed_requests(8))
    assert _pd_stats(cluster).budget.num_limited_steps > held_back


@pytest.mark.parametrize("model", ["tiny", QWEN], indirect=True)
def test_preemption_in_a_kv_pool_barely_larger_than_one_request(start_cluster, oracle, model):
    requests = _mixed_requests(6, SCALE[model])
    longest = max(_num_prompt_tokens(oracle, messages, images) for messages, images in requests)
    block_size = 16
    num_blocks = -(-(longest + MAX_TOKENS) // block_size) + 1
    # Every image in one batch of the encoder, so that their requests reach PD together and contend for the
    # pool: encoded one by one, each could finish before the next one's embedding arrived. No hold for images:
    # a held PD computes nothing of an image prompt before its image and then admits only what the pool fits;
    # without the hold the text before each image already holds KV when the images land together.
    one_batch = {"max_wait_ms": 3000.0, "max_batch_images": 16}
    cluster = start_cluster(encoder=one_batch, num_kv_blocks=num_blocks, block_size=block_size, image_hold_s=0.0)
    _check_concurrently(cluster, oracle, requests)
    assert _pd_stats(cluster).num_preemptions > 0, "the pool was meant to force preemption"


def _num_prompt_tokens(oracle: Oracle, messages: list[dict], images: list) -> int:
    return len(oracle.prompt_ids(messages, images))


@pytest.mark.parametrize(
    ("model", "with_image"),
    [("tiny", False), ("tiny", True), (QWEN, True)],
    ids=["text", "image", "qwen-image"],
    indirect=["model"],
)
def test_repeated_long_prompt_hits_the_prefix_cache(start_cluster, oracle, model, with_image):
    # Room for one image only: the image's embedding is evicted before the
    # repeat, which then must be served from the KV prefix cache alone.
    cluster = start_cluster(embedding_cache_tokens=16)
    size = (48, 48) if model == "tiny" else (64, 64)  # Qwen: 64x64 is 16 tokens, the whole cache
    images = [make_image(77, size)] if with_image else []
    question = "Summarise the facts above in three short sentences, and mention every number you saw there."
    messages = [{"role": "system", "content": LONG_TEXT}, user_message(question, images)]
    expected = oracle.generate(messages, images, MAX_TOKENS)
    first, first_usage = _chat(cluster, messages)
    if with_image:
        _chat(cluster, [user_message("Another picture.", [make_image(78)])])  # evicts the first image
    repeat, repeat_usage = _chat(cluster, messages)
    assert first == repeat == expected
    assert first_usage.prompt_tokens_details.cached_tokens == 0
    cached = repeat_usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and repeat_usage.prompt_tokens - 16 <= cached < repeat_usage.prompt_tokens
    if with_image:
        assert repeat_usage.model_extra["epd"]["num_images_ready"] == 1  # from cached KV: nothing encoded
    assert _pd_stats(cluster).num_prefix_hit_tokens == cached

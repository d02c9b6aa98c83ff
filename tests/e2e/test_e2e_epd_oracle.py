"""E+P+D: greedy output through encoder -> prefill PD -> decode PD equals transformers generate().

The proxy reserves KV on a decode instance first, the prefill instance
prefills (images pushed to it by the encoder), samples the first token and
pushes the prompt's KV to the decode instance, which streams the answer.
Requests go through the official ``openai`` client, streaming and not;
LLaVA and Qwen2.5-VL (M-RoPE: the decode side keeps the image tokens' 3-D
positions), images and videos. After every test, nothing is left reserved, held, pending or
referenced on any instance.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from cluster_support import InProcessCluster, chat, serving_preset
from oracle_support import make_image, user_message
from test_e2e_oracle import CASES, _chat
from test_e2e_video import _case as video_case

MAX_TOKENS = 16
SETUPS = {"llava": "tiny", "qwen2.5": "qwen2.5-vl-tiny"}
RUNS = {"llava": ["text_only", "one_image", "three_images"], "qwen2.5": ["text_only", "one_image", "wide_tall_square"]}


@pytest.fixture(scope="module")
def cluster(request, build_model):
    yield from serving_preset(build_model, SETUPS[request.param], num_pds=1, num_decodes=1)


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize(
    ("cluster", "case"), [(setup, case) for setup, cases in RUNS.items() for case in cases], indirect=["cluster"]
)
def test_greedy_tokens_equal_generate_through_prefill_and_decode(cluster, client, oracle, case, stream):
    text, images = CASES[case]
    messages = [user_message(text, images)]
    expected = oracle.generate(messages, images, MAX_TOKENS)
    token_ids, content, finish, usage = _chat(client, messages, stream, max_tokens=MAX_TOKENS)
    assert token_ids == expected
    assert content == oracle.decode(expected)
    assert finish == ("length" if len(expected) == MAX_TOKENS else "stop")
    assert usage.completion_tokens == len(expected)
    decode_stats = cluster.run(cluster.decodes[0].stats())
    assert decode_stats.num_steps > 0  # the decode instance generated
    counted = cluster.app.state.proxy.metrics.backend_requests
    for kind, address in (("pd", cluster.pd_addresses[0]), ("decode", cluster.decode_addresses[0])):
        assert counted.labels(kind, address, "OK")._value.get() > 0  # each side's outcome, counted apart


@pytest.mark.parametrize("cluster", ["llava", "qwen2.5"], indirect=True)
def test_sixteen_concurrent_mixed_requests(client, oracle):
    requests = []
    for i in range(16):
        images = [make_image(100 + i * 10 + k, (32 + 8 * k, 32 + 16 * (i % 2))) for k in range(i % 3)]
        messages = [{"role": "system", "content": "You are terse."}, user_message(f"Request {i}: describe.", images)]
        requests.append((messages, images, i % 2 == 1))
    expected = [oracle.generate(m, imgs, MAX_TOKENS) for m, imgs, _ in requests]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda r: _chat(client, r[0], r[2], max_tokens=MAX_TOKENS), requests))
    for want, (token_ids, content, _, _) in zip(expected, results):
        assert token_ids == want
        assert content == oracle.decode(want)


@pytest.mark.parametrize("cluster", ["llava", "qwen2.5"], indirect=True)
def test_a_burst_of_requests_for_one_new_image_is_token_exact(cluster, client, oracle):
    """16 at once with one image no instance has seen: the first push fills P's entry, the other requests
    prefill from it and end on P (first token, KV handed to D) while their own pushes are still on the
    way. Those late pushes are acknowledged; no request fails for a push it no longer needed."""
    image = make_image(900, (48, 40))
    requests = [([user_message(f"Burst {i}: what is this?", [image])], i % 2 == 1) for i in range(16)]
    expected = [oracle.generate(messages, [image], MAX_TOKENS) for messages, _ in requests]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda r: _chat(client, r[0], r[1], max_tokens=MAX_TOKENS), requests))
    for want, (token_ids, content, _, _) in zip(expected, results):
        assert token_ids == want
        assert content == oracle.decode(want)
    # the client fixture then checks every instance for leaks


@pytest.mark.parametrize("cluster", ["llava"], indirect=True)
def test_a_repeated_prompt_is_pushed_whole_again(cluster, client, oracle):
    text, images = CASES["one_image"]
    messages = [user_message(text + " Be precise." * 12, images)]
    expected = oracle.generate(messages, images, MAX_TOKENS)
    transfer = cluster.pds[0].servicer.kv
    pushed = []
    for _ in range(2):
        before = transfer.stats.sent.num_bytes
        token_ids, _, _, usage = _chat(client, messages, False, max_tokens=MAX_TOKENS)
        assert token_ids == expected
        pushed.append(transfer.stats.sent.num_bytes - before)
    # K/V that arrived by push is never another request's prefix on D (whoever holds the internal
    # token could push any): the second request's K/V is pushed whole again. P found the prompt in its
    # own prefix cache, which is what usage reports as cached (the computing it saved).
    assert pushed[1] == pushed[0] > 0
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("case", ["one_video", "video_and_image", "two_videos"])
@pytest.mark.parametrize("cluster", ["qwen2.5"], indirect=True)
def test_video_greedy_tokens_equal_generate_through_prefill_and_decode(cluster, client, oracle, case, stream):
    """Qwen2.5-VL spaces a video's temporal positions by its time rate: D's reservation must derive the
    same spans as the Generate that takes it over (every video was a 500 before)."""
    content, videos, images, extensions = video_case(case, oracle.processor.image_processor)
    messages = [{"role": "user", "content": content}]
    expected = oracle.generate(messages, images, MAX_TOKENS, videos=videos)
    token_ids, usage = chat(client, content, MAX_TOKENS, stream, **extensions)
    assert token_ids == expected
    merge = oracle.processor.image_processor.merge_size
    assert usage.model_extra["epd"]["video_tokens"] == sum(int(v.grid.prod()) // merge**2 for v in videos)
    assert cluster.run(cluster.decodes[0].stats()).num_steps > 0  # the decode instance generated


@pytest.mark.parametrize("cluster", ["llava"], indirect=True)
def test_a_cancelled_stream_leaves_nothing_on_any_instance(client):
    with client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[user_message("Tell me a long story.", [])],
        max_tokens=200,
        temperature=0,
        stream=True,
    ) as stream:
        next(iter(stream))
    # the client fixture checks every instance for leaks


@pytest.fixture
def pairs(build_model):
    """Two prefill and two decode instances behind the proxy (its own cluster: instances get stopped)."""
    cluster = InProcessCluster(str(build_model("tiny")), num_pds=2, num_decodes=2).start()
    cluster.preset = "tiny"
    yield cluster
    cluster.stop()


def _mixed(i: int):
    images = [make_image(300 + i * 10 + k, (32 + 8 * k, 40)) for k in range(i % 2)]
    return [user_message(f"Request {i}: describe.", images)], images


@pytest.mark.parametrize("stopped", ["decode", "prefill"])
def test_requests_fail_over_when_an_instance_is_gone(pairs, oracle_for, stopped):
    oracle = oracle_for("tiny")
    victim = (pairs.decodes if stopped == "decode" else pairs.pds)[0]
    pairs.run(victim.stop(0))
    with openai.OpenAI(base_url=pairs.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        for i in range(6):  # routing would send some of them to the stopped instance first
            messages, images = _mixed(i)
            assert _chat(client, messages, i % 2 == 0, max_tokens=MAX_TOKENS)[0] == oracle.generate(
                messages, images, MAX_TOKENS
            )
    survivors = [pd for pd in pairs.pds + pairs.decodes if pd is not victim]
    for pd in survivors:
        stats = pairs.run(pd.stats())
        assert stats.is_idle and stats.num_kv_blocks_used == 0


@pytest.mark.parametrize("cluster", ["qwen2.5"], indirect=True)
def test_an_abort_storm_leaves_nothing_on_any_instance(cluster, client, oracle):
    """24 requests, most abandoned at a different point (before a byte, after one or a few chunks),
    with and without images; then a request still comes back token-exact."""
    model = client.models.list().data[0].id

    def one(i: int) -> None:
        images = [make_image(500 + i)] if i % 2 else []
        stream = client.chat.completions.create(
            model=model,
            messages=[user_message(f"Storm {i}: tell a long story.", images)],
            max_tokens=64,
            temperature=0,
            stream=True,
            timeout=0.05 if i % 4 == 0 else 120,  # some give up before the first token
        )
        with stream:
            for count, _ in enumerate(stream):
                if count >= i % 3:
                    break

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(one, i) for i in range(24)]:
            try:
                future.result()
            except openai.APIError:
                pass  # the ones that timed out on the client side
    text, images = CASES["one_image"]
    messages = [user_message(text, images)]
    assert _chat(client, messages, True, max_tokens=MAX_TOKENS)[0] == oracle.generate(messages, images, MAX_TOKENS)
    # the client fixture then checks every instance for leaks


def test_without_a_decode_instance_the_proxy_is_not_ready_and_answers_503(pairs):
    for decode in pairs.decodes:
        pairs.run(decode.stop(0))
    health_url = pairs.base_url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + 20
    while httpx.get(health_url, timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "the proxy still reports ready without a decode PD"
        time.sleep(0.1)
    client = openai.OpenAI(base_url=pairs.base_url, api_key="unused", max_retries=0, timeout=60)
    with client, pytest.raises(openai.APIStatusError) as refused:
        _chat(client, [user_message("Hello.", [])], False, max_tokens=4)
    assert refused.value.status_code == 503
    for pd in pairs.pds:  # nothing left on the prefill PDs
        stats = pairs.run(pd.stats())
        assert stats.is_idle and stats.num_kv_blocks_used == 0


@pytest.mark.parametrize("cluster", ["llava"], indirect=True)
def test_a_client_gone_while_the_decode_instance_reserves_leaves_no_reservation(cluster, client, monkeypatch):
    """The proxy marked the attempt as holding something only once ReserveKV had answered: a client
    that left while the call was in flight left D's reservation to its lease."""
    kv = cluster.decodes[0].servicer.kv
    reserve = kv.reserve

    async def slow_reserve(*args, **kwargs):  # test double: the real reserve, answered late
        grant = await reserve(*args, **kwargs)
        await asyncio.sleep(1.0)
        return grant

    monkeypatch.setattr(kv, "reserve", slow_reserve)
    model = client.models.list().data[0].id
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(
            model=model, messages=[user_message("Gone early.", [])], max_tokens=4, timeout=0.3
        )
    # the client fixture then checks every instance for leaks

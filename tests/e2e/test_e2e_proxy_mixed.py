"""Must-show 1: two encoders + two PDs serve 200 mixed requests, token-exact, cached, spread.

Mixed = text-only and 1-4 images, about 30% of image slots repeating an
image sent before, greedy and sampled, streaming and not, at concurrency 8,
through the official ``openai`` client. Greedy outputs must equal
``transformers`` ``generate()`` token for token; repeated images must come
from a cache (PD embedding cache READY, or the encoder's cache via
rendezvous affinity); both PDs must carry a fair share.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from cluster_support import InProcessCluster
from oracle_support import Oracle, make_image, user_message

NUM_REQUESTS = 200
CONCURRENCY = 8
MAX_TOKENS = 8
REPEAT_FRACTION = 0.3


@dataclass
class Planned:
    """One request of the run, and what happened to it."""

    index: int
    text: str
    image_seeds: list[int]
    greedy: bool
    stream: bool
    sent: float = 0.0
    done: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    usage: object = None


def plan(seed: int = 0) -> list[Planned]:
    rng = random.Random(seed)
    used: list[int] = []
    next_seed = 1000
    requests = []
    for index in range(NUM_REQUESTS):
        seeds: list[int] = []
        for _ in range(0 if rng.random() < 0.25 else rng.randint(1, 4)):
            candidates = [s for s in used if s not in seeds]
            if candidates and rng.random() < REPEAT_FRACTION:
                seeds.append(rng.choice(candidates))
            else:
                seeds.append(next_seed)
                next_seed += 1
        used.extend(s for s in seeds if s not in used)
        requests.append(
            Planned(
                index,
                f"Request {index}: say something about {rng.choice(['cats', 'boats', 'rain'])}.",
                seeds,
                greedy=rng.random() < 0.75,
                stream=rng.random() < 0.5,
            )
        )
    return requests


def image_of(seed: int):
    return make_image(seed, (24 + 8 * (seed % 4), 32))


def messages_of(request: Planned) -> list[dict]:
    return [user_message(request.text, [image_of(s) for s in request.image_seeds])]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cluster = InProcessCluster(str(tiny_model_dir), num_encoders=2, num_pds=2, proxy={"load_poll_s": 0.2}).start()
    yield cluster
    cluster.stop()


def run_one(client: openai.OpenAI, model: str, request: Planned) -> None:
    kwargs = dict(
        model=model, messages=messages_of(request), max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True}
    )
    kwargs.update(temperature=0) if request.greedy else kwargs.update(temperature=0.9, seed=request.index)
    request.sent = time.monotonic()
    if request.stream:
        for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                request.usage = chunk.usage
            for choice in chunk.choices:
                request.token_ids += (choice.model_extra or {}).get("token_ids") or []
                request.finish = choice.finish_reason or request.finish
    else:
        reply = client.chat.completions.create(**kwargs)
        request.token_ids = reply.choices[0].model_extra["token_ids"]
        request.finish, request.usage = reply.choices[0].finish_reason, reply.usage
    request.done = time.monotonic()


def repeated_image_hits(requests: list[Planned]) -> tuple[int, int]:
    """(images served from a cache, repeated images) over the requests whose images are unambiguous.

    A repeated image was in a request that had completed before this one was
    sent; a new one was in no request sent before it. Requests with an image
    that was only in flight elsewhere are left out (it may or may not be
    cached by then). Usage counts hits per request, and new images cannot
    be hits, so each request's hits count against its repeated images.
    """
    first_sent: dict[int, float] = {}
    first_done: dict[int, float] = {}
    for request in requests:
        for s in request.image_seeds:
            first_sent[s] = min(first_sent.get(s, request.sent), request.sent)
            first_done[s] = min(first_done.get(s, request.done), request.done)
    hits = repeats = 0
    for request in requests:
        repeated = [s for s in request.image_seeds if first_done[s] < request.sent]
        new = [s for s in request.image_seeds if first_sent[s] == request.sent]
        if repeated and len(repeated) + len(new) == len(request.image_seeds):
            epd = request.usage.model_extra["epd"]
            repeats += len(repeated)
            hits += min(len(repeated), epd["num_images_ready"] + epd["num_encoder_cache_hits"])
    return hits, repeats


def pd_share(metrics_text: str) -> dict[str, float]:
    counts = {
        address: float(value)
        for address, value in re.findall(
            r'epd_proxy_backend_requests_total\{address="([^"]+)",kind="pd",status="OK"\} (\S+)', metrics_text
        )
    }
    return counts


def test_two_encoders_two_pds_mixed_traffic(cluster, tiny_model_dir):
    requests = plan()
    oracle = Oracle(str(tiny_model_dir))
    t0 = time.monotonic()
    with openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(lambda r: run_one(client, model, r), requests))  # raises on any failed request

    t1 = time.monotonic()
    # Every request finished normally; greedy ones equal generate() token for token.
    for request in requests:
        assert request.finish in ("stop", "length") and request.usage is not None, request.index
        assert request.usage.completion_tokens == len(request.token_ids)
        if request.greedy:
            images = [image_of(s) for s in request.image_seeds]
            assert request.token_ids == oracle.generate(messages_of(request), images, MAX_TOKENS), request.index

    hits, repeats = repeated_image_hits(requests)
    hit_rate = hits / repeats
    num_images = sum(len(r.image_seeds) for r in requests)
    metrics_text = httpx.get(cluster.base_url.removesuffix("/v1") + "/metrics").text
    shares = pd_share(metrics_text)
    total = sum(shares.values())
    print(
        f"\nmust-show 1: {len(requests)} requests in {t1 - t0:.1f}s at concurrency {CONCURRENCY} "
        f"({sum(r.greedy for r in requests)} greedy checked against "
        f"generate()), {num_images} images; repeated-image cache hit rate {hits}/{repeats} = {hit_rate:.1%}; "
        f"PD spread " + ", ".join(f"{a}: {n:.0f} ({n / total:.0%})" for a, n in sorted(shares.items()))
    )
    assert repeats >= 20 and hit_rate >= 0.9
    assert len(shares) == 2 and min(shares.values()) >= 0.25 * total
    assert cluster.leaks() == {}

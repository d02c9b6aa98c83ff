"""Must-show: after traffic, all three ``/metrics`` endpoints export every documented metric, plausibly.

One encoder, two PDs (round-robin, so a repeated image meets both the
encoder's cache and a PD's caches) and the proxy, with every ``/metrics``
endpoint on a free port. The test scrapes before and after a few requests
and checks that counters grew by what the responses report (token counts,
images), that the services agree with each other (the proxy's
``encoder_cache`` images are the encoder's cache hits), and that gauges are
back at their idle values.
"""

from __future__ import annotations

import time
import uuid

import grpc
import httpx
import openai
import pytest
from cluster_support import InProcessCluster
from oracle_support import make_image, user_message
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics_http import MetricDoc
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.encoder.metrics import METRICS as ENCODER_METRICS
from services.pd.metrics import METRICS as PD_METRICS
from services.proxy.metrics import METRICS as PROXY_METRICS

CHAT = "/v1/chat/completions"
MAX_TOKENS = 5


class Scrape:
    """One parsed exposition: sample values by name and labels, and the family names."""

    def __init__(self, text: str) -> None:
        self.families = {}
        self.samples: dict[str, list[tuple[dict, float]]] = {}
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):
                continue  # prometheus_client's creation timestamps, not ours to document
            self.families[family.name] = family.type
            for sample in family.samples:
                self.samples.setdefault(sample.name, []).append((sample.labels, sample.value))

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        return sum(v for got, v in self.samples.get(name, []) if labels.items() <= got.items())

    def exports(self, doc: MetricDoc) -> bool:
        family = doc.name.removesuffix("_total") if doc.type == "counter" else doc.name
        return self.families.get(family) == doc.type


def scrape(url: str) -> Scrape:
    reply = httpx.get(url, timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return Scrape(reply.text)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cluster = InProcessCluster(
        str(tiny_model_dir),
        num_encoders=1,
        num_pds=2,
        pd={"metrics_port": 0},
        encoder={"metrics_port": 0},
        proxy={"pd_policy": "round-robin"},
    ).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _urls(cluster) -> dict[str, list[str]]:
    return {
        "proxy": [f"http://127.0.0.1:{cluster.port}/metrics"],
        "encoder": [f"http://127.0.0.1:{e.metrics_http.port}/metrics" for e in cluster.encoders],
        "pd": [f"http://127.0.0.1:{p.metrics_http.port}/metrics" for p in cluster.pds],
    }


def _scrape_all(cluster) -> dict[str, list[Scrape]]:
    return {service: [scrape(url) for url in urls] for service, urls in _urls(cluster).items()}


def _total(scrapes: list[Scrape], name: str, **labels: str) -> float:
    return sum(s.value(name, **labels) for s in scrapes)


def _send_traffic(cluster) -> dict[str, int]:
    """Text, then one image three times (streamed twice); returns what the responses report."""
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    image_message = user_message("Describe it.", [make_image(7, (40, 40))])
    seen = {"prompt": 0, "completion": 0, "cached": 0, "streamed_gaps": 0, "requests": 0}

    def count(usage, streamed: bool) -> None:
        seen["requests"] += 1
        seen["prompt"] += usage.prompt_tokens
        seen["completion"] += usage.completion_tokens
        seen["cached"] += (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
        seen["streamed_gaps"] += usage.completion_tokens - 1 if streamed else 0

    reply = client.chat.completions.create(
        model=model,
        max_tokens=MAX_TOKENS,
        temperature=0,
        messages=[{"role": "user", "content": "Say something."}],
    )
    count(reply.usage, streamed=False)
    for streamed in (True, True, False):
        if streamed:
            chunks = list(
                client.chat.completions.create(
                    model=model,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    messages=[image_message],
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            count(chunks[-1].usage, streamed=True)
        else:
            reply = client.chat.completions.create(
                model=model,
                max_tokens=MAX_TOKENS,
                temperature=0,
                messages=[image_message],
            )
            count(reply.usage, streamed=False)
    return seen


def _expire_one_reservation(cluster) -> None:
    """A Preallocate nobody follows up: its lease runs out on PD 0."""
    with grpc.insecure_channel(cluster.pd_addresses[0]) as channel:
        stub = epd_pb2_grpc.PrefillDecodeStub(channel)
        item = epd_pb2.MultiModalItem(mm_hash=uuid.uuid4().hex * 2, offset=1, num_tokens=4)
        reply = stub.Preallocate(
            epd_pb2.PreallocateRequest(
                request_id=f"metrics-{uuid.uuid4().hex}",
                prompt_token_ids=[1] * 8,
                items=[item],
                lease_ms=1,
            ),
            timeout=30,
        )
    assert reply.items[0].state == epd_pb2.ItemAllocation.RESERVED


def _wait_for_expiry(cluster, before: float) -> Scrape:
    url = _urls(cluster)["pd"][0]
    for _ in range(200):  # the lease sweep runs every 0.25 s
        now = scrape(url)
        if now.value("epd_pd_reservations_expired_total") > before:
            return now
        time.sleep(0.05)
    raise AssertionError("the expired reservation never showed in epd_pd_reservations_expired_total")


def test_every_documented_metric_is_exported_with_plausible_values(cluster):
    before = _scrape_all(cluster)
    seen = _send_traffic(cluster)
    _expire_one_reservation(cluster)
    _wait_for_expiry(cluster, before["pd"][0].value("epd_pd_reservations_expired_total"))
    assert cluster.leaks() == {}
    after = _scrape_all(cluster)

    # Every documented metric is there, and nothing undocumented.
    for service, docs in (("proxy", PROXY_METRICS), ("encoder", ENCODER_METRICS), ("pd", PD_METRICS)):
        documented = {doc.name.removesuffix("_total") if doc.type == "counter" else doc.name for doc in docs}
        for scraped in after[service]:
            assert [doc.name for doc in docs if not scraped.exports(doc)] == [], service
            ours = {name for name in scraped.families if name.startswith("epd_")}
            assert ours <= documented, f"{service} exports undocumented metrics: {ours - documented}"

    def grew(service: str, name: str, **labels: str) -> float:
        return _total(after[service], name, **labels) - _total(before[service], name, **labels)

    def now(service: str, name: str, **labels: str) -> float:
        return _total(after[service], name, **labels)

    # Proxy: every request counted once, with its first token and its duration; idle again.
    assert grew("proxy", "epd_proxy_requests_total", endpoint=CHAT, status="200") == seen["requests"]
    assert grew("proxy", "epd_proxy_time_to_first_token_seconds_count", endpoint=CHAT) == seen["requests"]
    assert grew("proxy", "epd_proxy_request_duration_seconds_count", endpoint=CHAT) == seen["requests"]
    assert grew("proxy", "epd_proxy_request_duration_seconds_sum", endpoint=CHAT) > 0
    assert 0 < grew("proxy", "epd_proxy_inter_token_latency_seconds_count", endpoint=CHAT) <= seen["streamed_gaps"]
    assert now("proxy", "epd_proxy_requests_in_flight") == 0
    assert grew("proxy", "epd_proxy_images_total") == 3
    assert now("proxy", "epd_proxy_instance_ready") == 3  # 2 PDs + 1 encoder
    assert now("proxy", "epd_proxy_instance_outstanding") == 0
    assert now("proxy", "epd_proxy_instance_breaker_state") == 0

    # Encoder: what the proxy says came from it is what it counted.
    hits = grew("encoder", "epd_encoder_cache_hits_total")
    misses = grew("encoder", "epd_encoder_cache_misses_total")
    assert hits == grew("proxy", "epd_proxy_image_sources_total", source="encoder_cache")
    assert misses == grew("proxy", "epd_proxy_image_sources_total", source="encoded")
    assert misses >= 1 and hits + misses + grew("proxy", "epd_proxy_image_sources_total", source="pd_cache") == 3
    assert grew("encoder", "epd_encoder_images_total") == misses  # sequential: no shared in-flight encodes
    assert grew("encoder", "epd_encoder_batch_size_sum") == misses
    assert grew("encoder", "epd_encoder_encode_seconds_count") == grew("encoder", "epd_encoder_batch_size_count") >= 1
    assert grew("encoder", "epd_encoder_push_seconds_count") == hits + misses
    pushed = grew("encoder", "epd_encoder_push_bytes_total")
    assert pushed > 0 and pushed % (hits + misses) == 0  # the same image each time
    assert grew("encoder", "epd_encoder_requests_total", status="OK") == hits + misses
    assert now("encoder", "epd_encoder_cache_bytes") == pushed / (hits + misses)  # one embedding cached
    assert now("encoder", "epd_encoder_cache_entries") == 1
    assert now("encoder", "epd_encoder_queue_depth") == 0 and now("encoder", "epd_encoder_outbound_bytes") == 0
    assert (
        grew("encoder", "epd_encoder_failed_images_total") == grew("encoder", "epd_encoder_rejected_images_total") == 0
    )

    # PD: token counters match the usage the responses carried; idle gauges; the expired lease counted.
    assert grew("pd", "epd_pd_prompt_tokens_total") == seen["prompt"]
    assert grew("pd", "epd_pd_generation_tokens_total") == seen["completion"]
    assert grew("pd", "epd_pd_prefix_cache_hit_tokens_total") == seen["cached"] > 0
    assert grew("pd", "epd_pd_step_seconds_count") >= seen["requests"] * MAX_TOKENS / 2
    assert (
        grew("pd", "epd_pd_step_seconds_sum") > 0 and grew("pd", "epd_pd_step_phase_seconds_total", phase="execute") > 0
    )
    assert grew("pd", "epd_pd_reservations_expired_total") == 1
    assert now("pd", "epd_pd_running_requests") == now("pd", "epd_pd_waiting_requests") == 0
    assert now("pd", "epd_pd_kv_blocks_used") == 0 and now("pd", "epd_pd_kv_blocks_total") > 0
    assert now("pd", "epd_pd_embedding_cache_tokens", state="reserved") == 0
    assert now("pd", "epd_pd_embedding_cache_tokens", state="ready") > 0  # the image stays cached
    assert now("pd", "epd_pd_engine_responsive") == 2
    for scraped in after["pd"]:  # a histogram's +Inf bucket is its count
        assert scraped.value("epd_pd_step_seconds_bucket", le="+Inf") == scraped.value("epd_pd_step_seconds_count")
    # Step budget (default auto): the warm-up seeded the model, every later step was predicted.
    assert grew("pd", "epd_pd_step_time_prediction_ratio_count") == grew("pd", "epd_pd_step_seconds_count")
    assert grew("pd", "epd_pd_step_time_prediction_ratio_sum") > 0
    for scraped in after["pd"]:
        assert scraped.value("epd_pd_itl_target_seconds") > 0
        assert 16 <= scraped.value("epd_pd_step_budget_tokens") <= 2048


def test_metrics_endpoints_answer_only_get_metrics(cluster):
    for urls in _urls(cluster).values():
        base = urls[0].removesuffix("/metrics")
        assert httpx.get(base + "/nothing-here", timeout=10).status_code == 404
    encoder_url = _urls(cluster)["encoder"][0]
    assert httpx.post(encoder_url, timeout=10).status_code == 405
    assert httpx.get(encoder_url + "?name[]=x", timeout=10).status_code == 200

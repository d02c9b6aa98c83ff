"""Prometheus metrics of the proxy, on a registry owned by one app (no globals)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.common.metrics_http import MetricDoc, MetricsHttpServer
from services.proxy.backends.instances import Readiness

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


METRICS = (
    MetricDoc(
        "epd_proxy_requests_total",
        "counter",
        ("endpoint", "status"),
        "finished generation requests by HTTP status (a stream counts with the status its headers carried)",
    ),
    MetricDoc("epd_proxy_requests_in_flight", "gauge", ("endpoint",), "generation requests being served"),
    MetricDoc(
        "epd_proxy_time_to_first_token_seconds", "histogram", ("endpoint",), "arrival to the first token from PD"
    ),
    MetricDoc(
        "epd_proxy_inter_token_latency_seconds",
        "histogram",
        ("endpoint",),
        "gap between consecutive tokens of a streamed response, one sample per token",
    ),
    MetricDoc(
        "epd_proxy_request_duration_seconds",
        "histogram",
        ("endpoint",),
        "arrival to last byte of a successful request (end-to-end latency)",
    ),
    MetricDoc(
        "epd_proxy_client_limit_refusals_total",
        "counter",
        ("reason",),
        "429s from the per-client limits: requests (too many in flight) or tokens (bucket empty); "
        "the client is never a label",
    ),
    MetricDoc("epd_proxy_images_total", "counter", (), "images accepted in requests"),
    MetricDoc(
        "epd_proxy_stalls_total",
        "counter",
        ("kind",),
        "stalls cut short: first_token or inter_token (PD sent nothing in time; the generation ends), "
        "write (the client did not take a response write in time), encode (an encoder did not answer an "
        "Encode call within --encode-timeout-s; the image moves to another encoder)",
    ),
    MetricDoc(
        "epd_proxy_backend_requests_total",
        "counter",
        ("kind", "address", "status"),
        "PD attempts and Encode calls by instance and outcome (OK, a gRPC status name, CANCELLED)",
    ),
    MetricDoc(
        "epd_proxy_retries_total",
        "counter",
        ("kind", "code"),
        "calls moved to another instance, by the status that caused it",
    ),
    MetricDoc(
        "epd_proxy_image_sources_total",
        "counter",
        ("source",),
        "where image embeddings came from: pd_cache (READY on PD), encoder_cache, encoded",
    ),
    MetricDoc("epd_proxy_instance_ready", "gauge", ("kind", "address"), "1 when the instance's health says SERVING"),
    MetricDoc(
        "epd_proxy_instance_breaker_state",
        "gauge",
        ("kind", "address"),
        "circuit breaker: 0 closed, 1 half-open, 2 open",
    ),
    MetricDoc("epd_proxy_instance_outstanding", "gauge", ("kind", "address"), "this proxy's calls in flight"),
    MetricDoc(
        "epd_proxy_pd_route_decisions_total",
        "counter",
        ("reason",),
        "PDs chosen by the cache-aware policy, by why: cache (it held the longest prefix), load (no PD held "
        "more than another), load_over_cache (another held more, but its load outweighed it)",
    ),
    MetricDoc(
        "epd_proxy_pd_route_prompt_tokens_total",
        "counter",
        (),
        "prompt tokens of the requests the cache-aware policy routed",
    ),
    MetricDoc(
        "epd_proxy_pd_route_hit_tokens_total",
        "counter",
        (),
        "of those, the tokens the chosen PD held (cached prefix, and images past it held as embeddings)",
    ),
    MetricDoc(
        "epd_proxy_cache_index_entries",
        "gauge",
        ("address",),
        "block keys and image hashes the cache index holds for a PD (from its cache events)",
    ),
    MetricDoc(
        "epd_proxy_cache_index_bytes",
        "gauge",
        (),
        "the cache index's memory estimate, kept under --pd-cache-index-mb",
    ),
    MetricDoc(
        "epd_proxy_cache_event_lag_seconds",
        "histogram",
        (),
        "age of a PD's cache-event batch when the proxy applied it (PD's wall clock to the proxy's)",
    ),
    MetricDoc(
        "epd_proxy_cache_event_resyncs_total",
        "counter",
        ("reason",),
        "cache-event streams ended and resubscribed (a fresh snapshot): gap (a sequence number skipped), "
        "fell_behind (PD dropped a slow subscriber), ended (PD closed it: draining or gone), error (any other)",
    ),
)
"""Everything ``ProxyMetrics`` exports; ``endpoint`` is /v1/chat/completions or /v1/completions."""


class ProxyMetrics:
    """``epd_proxy_*`` metrics (see ``METRICS``); instance gauges are read at scrape time (``watch_instances``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "epd_proxy_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.in_flight = Gauge(
            "epd_proxy_requests_in_flight", "Requests being served", ["endpoint"], registry=self.registry
        )
        self.first_token = Histogram(
            "epd_proxy_time_to_first_token_seconds",
            "Arrival to first token",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "epd_proxy_inter_token_latency_seconds",
            "Gap between consecutive streamed tokens",
            ["endpoint"],
            buckets=_TOKEN_GAP_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "epd_proxy_request_duration_seconds",
            "Arrival to completion of successful requests",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.client_limit_refusals = Counter(
            "epd_proxy_client_limit_refusals", "429s from the per-client limits", ["reason"], registry=self.registry
        )
        self.images = Counter("epd_proxy_images", "Images accepted", registry=self.registry)
        self.stalls = Counter(
            "epd_proxy_stalls", "Stalls cut short (PD, encoder or client)", ["kind"], registry=self.registry
        )
        self.backend_requests = Counter(
            "epd_proxy_backend_requests",
            "PD attempts and Encode calls by instance and outcome",
            ["kind", "address", "status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "epd_proxy_retries", "Calls moved to another instance", ["kind", "code"], registry=self.registry
        )
        self.image_sources = Counter(
            "epd_proxy_image_sources", "Where image embeddings came from", ["source"], registry=self.registry
        )
        self.route_decisions = Counter(
            "epd_proxy_pd_route_decisions", "Cache-aware PD choices by reason", ["reason"], registry=self.registry
        )
        self.route_prompt_tokens = Counter(
            "epd_proxy_pd_route_prompt_tokens", "Prompt tokens routed by the cache-aware policy", registry=self.registry
        )
        self.route_hit_tokens = Counter(
            "epd_proxy_pd_route_hit_tokens", "Prompt tokens the chosen PD held", registry=self.registry
        )
        self.cache_event_lag = Histogram(
            "epd_proxy_cache_event_lag_seconds",
            "Age of a PD cache-event batch when applied",
            buckets=_LAG_BUCKETS,
            registry=self.registry,
        )
        self.cache_event_resyncs = Counter(
            "epd_proxy_cache_event_resyncs", "Cache-event streams resubscribed", ["reason"], registry=self.registry
        )

    def token_gaps(self, endpoint: str, *, enabled: bool = True) -> TokenGaps:
        """A timer for one response's inter-token latency (``enabled=False``: observes nothing)."""
        return TokenGaps(self.inter_token.labels(endpoint) if enabled else None)

    def watch_instances(self, instances: Callable[[], Iterable[Any]]) -> None:
        """Exports the state of ``instances()`` (PD and encoder clients) at every scrape."""
        self.registry.register(_InstanceCollector(instances))

    def watch_cache_index(self, index: Any | None) -> None:
        """Exports the size of ``index`` (the cache-aware policy's ``CacheIndex``; None: empty) at every scrape."""
        self.registry.register(_CacheIndexCollector(index))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def serve(self, host: str, port: int, *, token: str | None = None) -> MetricsHttpServer:
        """Serves ``GET /metrics`` on ``host:port`` (0 = a free port), the proxy's scrape port
        (``--metrics-port``); with ``token``, only to callers bearing it."""

        async def render() -> bytes:
            return self.render()

        return await MetricsHttpServer.start(host, port, render, token=token)


class TokenGaps:
    """Observes the time since the previous message, split evenly over the tokens it carries."""

    def __init__(self, histogram: Any | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._histogram = histogram
        self._clock = clock
        self._last: float | None = None

    def add(self, num_tokens: int) -> None:
        """A message with ``num_tokens`` new tokens arrived now (the first one only starts the clock)."""
        if num_tokens <= 0 or self._histogram is None:
            return
        now = self._clock()
        if self._last is not None:
            gap = (now - self._last) / num_tokens
            for _ in range(num_tokens):
                self._histogram.observe(gap)
        self._last = now


class _InstanceCollector:
    """Scrape-time gauges over the live instance list (instances come and go with DNS)."""

    def __init__(self, instances: Callable[[], Iterable[Any]]) -> None:
        self._instances = instances

    def describe(self) -> list:
        return []  # unchecked collector: families are built at collect time

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["kind", "address"]
        ready = GaugeMetricFamily("epd_proxy_instance_ready", "1 when health says SERVING", labels=labels)
        breaker = GaugeMetricFamily("epd_proxy_instance_breaker_state", "0 closed, 1 half-open, 2 open", labels=labels)
        outstanding = GaugeMetricFamily("epd_proxy_instance_outstanding", "This proxy's calls in flight", labels=labels)
        for instance in self._instances():
            key = [instance.kind, instance.address]
            ready.add_metric(key, float(instance.readiness is Readiness.READY))
            breaker.add_metric(key, float(instance.breaker.state))
            outstanding.add_metric(key, float(instance.num_outstanding))
        return [ready, breaker, outstanding]


class _CacheIndexCollector:
    """Scrape-time gauges of the cache-aware policy's index."""

    def __init__(self, index: Any | None) -> None:
        self._index = index

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        entries = GaugeMetricFamily("epd_proxy_cache_index_entries", "Cache index entries of a PD", labels=["address"])
        index = self._index
        for address, count in (index.sizes() if index is not None else {}).items():
            entries.add_metric([address], float(count))
        size = GaugeMetricFamily("epd_proxy_cache_index_bytes", "Cache index memory estimate")
        size.add_metric([], float(index.num_bytes if index is not None else 0))
        return [entries, size]

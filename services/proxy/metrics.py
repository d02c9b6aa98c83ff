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

    def token_gaps(self, endpoint: str, *, enabled: bool = True) -> TokenGaps:
        """A timer for one response's inter-token latency (``enabled=False``: observes nothing)."""
        return TokenGaps(self.inter_token.labels(endpoint) if enabled else None)

    def watch_instances(self, instances: Callable[[], Iterable[Any]]) -> None:
        """Exports the state of ``instances()`` (PD and encoder clients) at every scrape."""
        self.registry.register(_InstanceCollector(instances))

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

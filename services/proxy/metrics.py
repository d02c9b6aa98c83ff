"""Prometheus metrics of the proxy, on a registry owned by one app (no globals)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.proxy.instances import Readiness

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ProxyMetrics:
    """``epd_proxy_*`` metrics.

    - ``epd_proxy_requests_total{endpoint,status}``: finished HTTP requests by status
      (a stream counts with the status its headers carried).
    - ``epd_proxy_requests_in_flight{endpoint}``: requests being served.
    - ``epd_proxy_time_to_first_token_seconds{endpoint}``: arrival -> first PD message.
    - ``epd_proxy_request_duration_seconds{endpoint}``: arrival -> last byte of a successful request.
    - ``epd_proxy_images_total``: images accepted in requests.
    - ``epd_proxy_backend_requests_total{kind,address,status}``: PD attempts and Encode calls by
      instance and outcome (``OK``, a gRPC status name, or ``CANCELLED``).
    - ``epd_proxy_retries_total{kind,code}``: calls moved to another instance, by the status that caused it.
    - ``epd_proxy_image_sources_total{source}``: where image embeddings came from:
      ``pd_cache`` (READY on PD), ``encoder_cache`` (encoder cache hit), ``encoded``.
    - ``epd_proxy_instance_ready{kind,address}``, ``epd_proxy_instance_breaker_state{kind,address}``
      (0 closed, 1 half-open, 2 open), ``epd_proxy_instance_outstanding{kind,address}``: live view
      of every instance, read at scrape time (``watch_instances``).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "epd_proxy_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.in_flight = Gauge(
            "epd_proxy_requests_in_flight", "Requests being served", ["endpoint"], registry=self.registry
        )
        self.first_token = Histogram(
            "epd_proxy_time_to_first_token_seconds", "Arrival to first token", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.duration = Histogram(
            "epd_proxy_request_duration_seconds", "Arrival to completion of successful requests", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.images = Counter("epd_proxy_images", "Images accepted", registry=self.registry)
        self.backend_requests = Counter(
            "epd_proxy_backend_requests", "PD attempts and Encode calls by instance and outcome",
            ["kind", "address", "status"], registry=self.registry,
        )
        self.retries = Counter(
            "epd_proxy_retries", "Calls moved to another instance", ["kind", "code"], registry=self.registry
        )
        self.image_sources = Counter(
            "epd_proxy_image_sources", "Where image embeddings came from", ["source"], registry=self.registry
        )

    def watch_instances(self, instances: Callable[[], Iterable[Any]]) -> None:
        """Exports the state of ``instances()`` (PD and encoder clients) at every scrape."""
        self.registry.register(_InstanceCollector(instances))

    def render(self) -> bytes:
        return generate_latest(self.registry)


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

"""Prometheus metrics of the proxy, on a registry owned by one app (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

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

    def render(self) -> bytes:
        return generate_latest(self.registry)

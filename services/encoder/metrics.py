"""The metrics seam of the encoder, and its Prometheus exporter.

The batcher, pusher and servicer report events to an ``EncoderMetrics``;
the base class ignores them. ``PrometheusEncoderMetrics`` exports them as
``epd_encoder_*`` metrics on its own registry (no globals, so several
encoders in one process do not collide); ``start_encoder`` builds one and
serves it on ``--metrics-port`` unless the caller passes its own sink.
Methods are called from the event loop, except ``on_batch`` and
``on_dropped`` which the worker thread may call, so implementations must be
thread-safe (prometheus_client's metrics are).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from services.common.metrics_http import MetricDoc, MetricsHttpServer


class EncoderMetrics:
    """No-op event sink; override the methods to export metrics."""

    def on_batch(self, num_images: int, forward_s: float, ok: bool) -> None:
        """A vision forward over ``num_images`` images finished (worker thread)."""

    def on_dropped(self, num_images: int, reason: str) -> None:
        """Queued images were dropped at dequeue (``reason``: deadline, cancelled, shutdown)."""

    def on_rejected(self) -> None:
        """An image was refused because the pending queue was full."""

    def on_item(self, cache_hit: bool, encode_s: float, push_s: float, num_bytes: int = 0) -> None:
        """One Encode item finished successfully; its push carried ``num_bytes`` embedding bytes."""

    def on_request(self, code_name: str, duration_s: float) -> None:
        """One Encode call ended with status ``code_name`` (e.g. ``"OK"``)."""


DROP_REASONS = ("deadline", "cancelled", "shutdown")
_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

METRICS = (
    MetricDoc("epd_encoder_images_total", "counter", (), "images that went through a successful vision forward"),
    MetricDoc("epd_encoder_failed_images_total", "counter", (), "images whose batch forward raised"),
    MetricDoc(
        "epd_encoder_dropped_images_total",
        "counter",
        ("reason",),
        "queued images dropped before encoding: deadline, cancelled (caller gone), shutdown",
    ),
    MetricDoc(
        "epd_encoder_rejected_images_total",
        "counter",
        (),
        "images refused with RESOURCE_EXHAUSTED because the pending queue was full",
    ),
    MetricDoc("epd_encoder_cache_hits_total", "counter", (), "items served from the embedding cache"),
    MetricDoc(
        "epd_encoder_cache_misses_total",
        "counter",
        (),
        "items not in the cache (encoded, or joined an identical in-flight encode)",
    ),
    MetricDoc("epd_encoder_cache_bytes", "gauge", (), "bytes held by the embedding cache"),
    MetricDoc("epd_encoder_cache_entries", "gauge", (), "embeddings held by the embedding cache"),
    MetricDoc("epd_encoder_queue_depth", "gauge", (), "images queued or being encoded"),
    MetricDoc("epd_encoder_outbound_bytes", "gauge", (), "embedding bytes of pushes in flight to PDs"),
    MetricDoc("epd_encoder_batch_size", "histogram", (), "images per vision forward"),
    MetricDoc(
        "epd_encoder_encode_seconds", "histogram", (), "duration of one batch forward (vision tower + projector)"
    ),
    MetricDoc(
        "epd_encoder_push_seconds", "histogram", (), "one item's push to PD, waiting for outbound capacity included"
    ),
    MetricDoc("epd_encoder_push_bytes_total", "counter", (), "embedding bytes pushed to PDs"),
    MetricDoc(
        "epd_encoder_requests_total",
        "counter",
        ("status",),
        "Encode calls by final status (OK, a gRPC status name, CANCELLED)",
    ),
    MetricDoc("epd_encoder_request_seconds", "histogram", (), "Encode call duration, any status"),
)
"""Everything ``PrometheusEncoderMetrics`` exports (the README table is made from it)."""


class PrometheusEncoderMetrics(EncoderMetrics):
    """``epd_encoder_*`` metrics (see ``METRICS``) on a registry owned by this instance."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.images = Counter("epd_encoder_images", "Images through a successful vision forward", registry=r)
        self.failed_images = Counter("epd_encoder_failed_images", "Images whose batch forward raised", registry=r)
        self.dropped = Counter(
            "epd_encoder_dropped_images", "Queued images dropped before encoding", ["reason"], registry=r
        )
        for reason in DROP_REASONS:
            self.dropped.labels(reason)  # exported as 0 until the first drop
        self.rejected = Counter("epd_encoder_rejected_images", "Images refused: pending queue full", registry=r)
        self.cache_hits = Counter("epd_encoder_cache_hits", "Items served from the embedding cache", registry=r)
        self.cache_misses = Counter("epd_encoder_cache_misses", "Items not found in the embedding cache", registry=r)
        self.batch_size = Histogram(
            "epd_encoder_batch_size", "Images per vision forward", buckets=_BATCH_SIZES, registry=r
        )
        self.encode_seconds = Histogram(
            "epd_encoder_encode_seconds", "Duration of one batch forward", buckets=_SECONDS, registry=r
        )
        self.push_seconds = Histogram(
            "epd_encoder_push_seconds", "Duration of one item's push to PD", buckets=_SECONDS, registry=r
        )
        self.push_bytes = Counter("epd_encoder_push_bytes", "Embedding bytes pushed to PDs", registry=r)
        self.requests = Counter("epd_encoder_requests", "Encode calls by final status", ["status"], registry=r)
        self.request_seconds = Histogram(
            "epd_encoder_request_seconds", "Encode call duration", buckets=_SECONDS, registry=r
        )

    # -- events (EncoderMetrics) -------------------------------------------
    def on_batch(self, num_images: int, forward_s: float, ok: bool) -> None:
        if not ok:
            self.failed_images.inc(num_images)
            return
        self.images.inc(num_images)
        self.batch_size.observe(num_images)
        self.encode_seconds.observe(forward_s)

    def on_dropped(self, num_images: int, reason: str) -> None:
        self.dropped.labels(reason).inc(num_images)

    def on_rejected(self) -> None:
        self.rejected.inc()

    def on_item(self, cache_hit: bool, encode_s: float, push_s: float, num_bytes: int = 0) -> None:
        (self.cache_hits if cache_hit else self.cache_misses).inc()
        self.push_seconds.observe(push_s)
        self.push_bytes.inc(num_bytes)

    def on_request(self, code_name: str, duration_s: float) -> None:
        self.requests.labels(code_name).inc()
        self.request_seconds.observe(duration_s)

    # -- export --------------------------------------------------------------
    def watch(self, stats: Callable[[], Any]) -> None:
        """Exports the gauges of ``stats()`` (an ``EncoderStats``) at every scrape."""
        self.registry.register(_StatsCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def serve(
        self, host: str, port: int, stats: Callable[[], Any], *, token: str | None = None
    ) -> MetricsHttpServer:
        """Watches ``stats`` and serves ``GET /metrics`` on ``host:port`` (0 = a free port).

        ``token``: scrapes must carry ``Authorization: Bearer <token>`` (None = open).
        """
        self.watch(stats)

        async def render() -> bytes:
            return self.render()

        return await MetricsHttpServer.start(host, port, render, token=token)


class _StatsCollector:
    """Scrape-time gauges read from the encoder's thread-safe counters."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> list:
        return []  # unchecked collector: families are built at collect time

    def collect(self) -> Iterable[GaugeMetricFamily]:
        stats = self._stats()
        return [
            GaugeMetricFamily("epd_encoder_cache_bytes", "Bytes held by the embedding cache", value=stats.cache_bytes),
            GaugeMetricFamily("epd_encoder_cache_entries", "Embeddings in the cache", value=stats.num_cached),
            GaugeMetricFamily("epd_encoder_queue_depth", "Images queued or being encoded", value=stats.num_pending),
            GaugeMetricFamily(
                "epd_encoder_outbound_bytes", "Embedding bytes of pushes in flight", value=stats.outbound_bytes
            ),
        ]

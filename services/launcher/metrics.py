"""``epd up``'s own metrics: restarts, readiness, crash loops and health kills per service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from services.common.metrics_http import MetricDoc

METRICS = (
    MetricDoc(
        "epd_launcher_restarts_total",
        "counter",
        ("service",),
        "restarts of a child of `epd up` after it exited unexpectedly",
    ),
    MetricDoc(
        "epd_launcher_service_up",
        "gauge",
        ("service",),
        "1 while the child is running and has reported ready, 0 while starting or waiting to restart",
    ),
    MetricDoc(
        "epd_launcher_crash_looping",
        "gauge",
        ("service",),
        "1 once the child crash-looped and was left down (the others keep serving), else 0",
    ),
    MetricDoc(
        "epd_launcher_health_kills_total",
        "counter",
        ("service",),
        "children killed because they stopped answering their liveness RPC (hung), then restarted",
    ),
)


class LauncherMetrics:
    """``epd_launcher_*`` on a registry of its own (served by ``epd up --launcher-metrics-port``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "epd_launcher_restarts", "Child restarts after an unexpected exit", ["service"], registry=self.registry
        )
        self.up = Gauge(
            "epd_launcher_service_up", "1 while the child runs and reported ready", ["service"], registry=self.registry
        )
        self.crash_looping = Gauge(
            "epd_launcher_crash_looping",
            "1 once the child crash-looped and was left down",
            ["service"],
            registry=self.registry,
        )
        self.health_kills = Counter(
            "epd_launcher_health_kills",
            "Children killed for failing their liveness checks",
            ["service"],
            registry=self.registry,
        )

    async def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics of a PD instance (``epd_pd_*``), read from its engine at scrape time.

The scheduler, caches and step counters belong to the engine thread, so a
scrape does not read them from the HTTP side: it asks the engine core for its
``EngineStats`` between two steps (``EngineBridge.shared_stats``) and renders
that. When the engine does not answer in time (stopped, or stuck in a long
step) the last stats are served and ``epd_pd_engine_responsive`` is 0; the
scrapes that time out meanwhile share one queued read, so a stuck engine
does not collect one per scrape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from services.common.metrics_http import MetricDoc, MetricsHttpServer
from services.pd.bridge import EngineBridge
from services.pd.engine.engine_stats import EngineStats
from services.pd.engine.errors import EngineError
from services.pd.engine.step_budget import PREDICTION_RATIO_BUCKETS, BudgetSnapshot
from services.pd.engine.step_stats import STEP_SECONDS_BUCKETS, StepSnapshot
from services.pd.kv_transfer import KVTransferStats

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 2.0
"""Longest a scrape waits for the engine thread (a step in progress) before serving the last snapshot."""

METRICS = (
    MetricDoc("epd_pd_running_requests", "gauge", (), "requests holding KV blocks (prefilling or decoding)"),
    MetricDoc("epd_pd_waiting_requests", "gauge", (), "requests queued for admission (preempted ones included)"),
    MetricDoc("epd_pd_kv_blocks_used", "gauge", (), "KV cache blocks in use by requests or pins"),
    MetricDoc("epd_pd_kv_blocks_total", "gauge", (), "KV cache blocks in the pool"),
    MetricDoc(
        "epd_pd_prefix_cache_hit_tokens_total",
        "counter",
        (),
        "prompt tokens served from the prefix cache at admission (a re-admission after preemption counts again)",
    ),
    MetricDoc(
        "epd_pd_embedding_cache_tokens",
        "gauge",
        ("state",),
        "image-embedding cache rows by state: reserved (waiting for a push), ready",
    ),
    MetricDoc("epd_pd_embedding_cache_capacity_tokens", "gauge", (), "image-embedding cache capacity in rows"),
    MetricDoc(
        "epd_pd_reservations_expired_total",
        "counter",
        (),
        "Preallocate leases that ran out unused: one per image reservation, one per prefix-KV pin",
    ),
    MetricDoc("epd_pd_step_seconds", "histogram", (), "duration of one engine step (schedule + model + update)"),
    MetricDoc(
        "epd_pd_step_phase_seconds_total",
        "counter",
        ("phase",),
        "engine step time by phase: schedule, execute (model runner), update (accounting, detokenizing)",
    ),
    MetricDoc(
        "epd_pd_prompt_tokens_total",
        "counter",
        (),
        "prompt tokens of requests that got their first token (cached tokens included)",
    ),
    MetricDoc("epd_pd_generation_tokens_total", "counter", (), "tokens sampled by the model"),
    MetricDoc(
        "epd_pd_step_budget_tokens",
        "gauge",
        (),
        "prefill tokens the last step was allowed (--max-num-batched-tokens with nothing decoding)",
    ),
    MetricDoc(
        "epd_pd_itl_target_seconds",
        "gauge",
        (),
        "inter-token latency the step budget keeps (0 = off; auto: 0 until a step decoded)",
    ),
    MetricDoc(
        "epd_pd_ttft_target_seconds",
        "gauge",
        (),
        "time-to-first-token target of a typical prompt (256 tokens; auto targets grow with longer prompts; 0 = off)",
    ),
    MetricDoc(
        "epd_pd_ttft_target_missed_total",
        "counter",
        (),
        "requests whose first token came later than their TTFT target (time waiting for images excluded)",
    ),
    MetricDoc(
        "epd_pd_itl_target_missed_total",
        "counter",
        (),
        "finished requests whose mean inter-token latency exceeded the ITL target in force when they finished",
    ),
    MetricDoc(
        "epd_pd_step_time_prediction_ratio",
        "histogram",
        (),
        "a step's measured / predicted duration, 1 = exact (the step-time model the budget is sized with)",
    ),
    MetricDoc("epd_pd_preemptions_total", "counter", (), "running requests preempted for lack of KV blocks"),
    MetricDoc(
        "epd_pd_captured_paths",
        "gauge",
        ("path",),
        "1 when a fast decode path is in use: static_decode (static buffers), flex_kernel (compiled "
        "flex_attention), cuda_graphs (replayed CUDA graphs); fixed at start-up",
    ),
    MetricDoc(
        "epd_pd_kv_reservations",
        "gauge",
        ("role",),
        "KV hand-off: live ReserveKV reservations (decode side), held prefills waiting for their push (prefill side)",
    ),
    MetricDoc(
        "epd_pd_kv_reservations_expired_total", "counter", ("role",), "KV reservations whose lease ran out unused"
    ),
    MetricDoc(
        "epd_pd_kv_push_bytes_total",
        "counter",
        ("role",),
        "KV bytes pushed to decode instances (prefill) or written from pushes (decode)",
    ),
    MetricDoc(
        "epd_pd_kv_push_seconds_total",
        "counter",
        ("role",),
        "time spent in KV pushes that landed: read, send and the decode side's write (prefill); receive and write (decode)",
    ),
    MetricDoc("epd_pd_kv_pushes_total", "counter", ("role",), "KV pushes that landed"),
    MetricDoc(
        "epd_pd_engine_responsive",
        "gauge",
        (),
        "1 when this scrape read the engine; 0 when it did not answer in time (values are the last read)",
    ),
)
"""Everything ``PdMetrics`` exports (the README table is made from it)."""


class PdMetrics:
    """``epd_pd_*`` metrics (see ``METRICS``) of one engine, on a registry owned by this instance."""

    def __init__(
        self,
        engine: EngineBridge,
        snapshot_timeout_s: float = SNAPSHOT_TIMEOUT_S,
        decode_paths: Mapping[str, bool] | None = None,
        transfer: KVTransferStats | None = None,
    ) -> None:
        """``decode_paths``: the runner's ``decode_paths()`` (fixed at start-up; none = not exported).
        ``transfer``: the KV hand-off's counters (none = not exported)."""
        self._engine = engine
        self._transfer = transfer
        self._decode_paths = dict(decode_paths or {})
        self._timeout_s = snapshot_timeout_s
        self._latest: EngineStats | None = None
        self._responsive = False
        self.registry = CollectorRegistry()
        self.registry.register(self)

    async def refresh(self) -> None:
        """Reads fresh stats on the engine thread; keeps the last ones if the engine does not answer."""
        try:
            self._latest = await asyncio.wait_for(self._engine.shared_stats(), self._timeout_s)
            self._responsive = True
        except (EngineError, TimeoutError):
            self._responsive = False
            log.warning("engine stopped or busy over %.1fs: this scrape serves the last values", self._timeout_s)

    async def render(self) -> bytes:
        await self.refresh()
        return generate_latest(self.registry)

    async def serve(self, host: str, port: int, *, token: str | None = None) -> MetricsHttpServer:
        """Serves ``GET /metrics`` on ``host:port`` (0 = a free port); with ``token``, only to callers bearing it."""
        return await MetricsHttpServer.start(host, port, self.render, token=token)

    # -- prometheus_client collector -------------------------------------------
    def describe(self) -> list:
        return []  # unchecked collector: families are built at collect time

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "epd_pd_engine_responsive", "1 when this scrape read the engine", value=float(self._responsive)
        )
        s = self._latest
        if s is None:
            return
        yield GaugeMetricFamily("epd_pd_running_requests", "Requests holding KV blocks", value=s.num_running)
        yield GaugeMetricFamily("epd_pd_waiting_requests", "Requests queued for admission", value=s.num_waiting)
        yield GaugeMetricFamily("epd_pd_kv_blocks_used", "KV cache blocks in use", value=s.num_kv_blocks_used)
        yield GaugeMetricFamily("epd_pd_kv_blocks_total", "KV cache blocks in the pool", value=s.num_kv_blocks_total)
        yield CounterMetricFamily(
            "epd_pd_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            value=s.num_prefix_hit_tokens,
        )
        tokens = GaugeMetricFamily(
            "epd_pd_embedding_cache_tokens", "Image-embedding cache rows by state", labels=["state"]
        )
        tokens.add_metric(["reserved"], s.reserved_tokens)
        tokens.add_metric(["ready"], s.ready_tokens)
        yield tokens
        yield GaugeMetricFamily(
            "epd_pd_embedding_cache_capacity_tokens", "Image-embedding cache capacity in rows", value=s.capacity_tokens
        )
        yield CounterMetricFamily(
            "epd_pd_reservations_expired", "Preallocate leases that ran out unused", value=s.num_expired_leases
        )
        yield from _step_families(s.steps)
        yield from _budget_families(s.budget)
        yield CounterMetricFamily(
            "epd_pd_preemptions", "Requests preempted for lack of KV blocks", value=s.num_preemptions
        )
        if self._transfer is not None:
            yield from _transfer_families(s, self._transfer)
        if self._decode_paths:
            paths = GaugeMetricFamily("epd_pd_captured_paths", "Fast decode paths in use", labels=["path"])
            for path, used in self._decode_paths.items():
                paths.add_metric([path], float(used))
            yield paths


def _transfer_families(s: EngineStats, transfer: KVTransferStats) -> Iterable[Metric]:
    """The KV hand-off's families, one sample per side (``role``: prefill pushes, decode receives)."""
    live = GaugeMetricFamily("epd_pd_kv_reservations", "KV hand-off reservations held", labels=["role"])
    live.add_metric(["decode"], s.num_kv_reservations)
    live.add_metric(["prefill"], s.num_kv_exports)
    yield live
    expired = CounterMetricFamily("epd_pd_kv_reservations_expired", "KV reservations expired", labels=["role"])
    expired.add_metric(["decode"], s.num_expired_kv_reservations)
    yield expired
    for name, help_text, sent, received in (
        ("epd_pd_kv_push_bytes", "KV bytes pushed", transfer.sent.num_bytes, transfer.received.num_bytes),
        ("epd_pd_kv_push_seconds", "Time in KV pushes", transfer.sent.seconds, transfer.received.seconds),
        ("epd_pd_kv_pushes", "KV pushes that landed", transfer.sent.num_pushes, transfer.received.num_pushes),
    ):
        family = CounterMetricFamily(name, help_text, labels=["role"])
        family.add_metric(["prefill"], sent)
        family.add_metric(["decode"], received)
        yield family


def _step_families(steps: StepSnapshot) -> Iterable[Metric]:
    yield _histogram(
        "epd_pd_step_seconds",
        "Duration of one engine step",
        STEP_SECONDS_BUCKETS,
        steps.bucket_counts,
        steps.sum_seconds,
    )
    phases = CounterMetricFamily("epd_pd_step_phase_seconds", "Engine step time by phase", labels=["phase"])
    for phase, seconds in steps.seconds.items():
        phases.add_metric([phase], seconds)
    yield phases
    yield CounterMetricFamily(
        "epd_pd_prompt_tokens", "Prompt tokens of requests that got their first token", value=steps.num_prompt_tokens
    )
    yield CounterMetricFamily(
        "epd_pd_generation_tokens", "Tokens sampled by the model", value=steps.num_generation_tokens
    )


def _budget_families(budget: BudgetSnapshot) -> Iterable[Metric]:
    yield GaugeMetricFamily(
        "epd_pd_step_budget_tokens", "Prefill tokens the last step was allowed", value=budget.prefill_budget_tokens
    )
    yield GaugeMetricFamily(
        "epd_pd_itl_target_seconds", "Inter-token latency the step budget keeps", value=budget.itl_target_s
    )
    yield GaugeMetricFamily(
        "epd_pd_ttft_target_seconds", "Time-to-first-token target of a typical prompt", value=budget.ttft_target_s
    )
    yield CounterMetricFamily(
        "epd_pd_ttft_target_missed", "Requests whose first token missed the TTFT target", value=budget.num_ttft_missed
    )
    yield CounterMetricFamily(
        "epd_pd_itl_target_missed",
        "Requests whose inter-token latency missed the ITL target",
        value=budget.num_itl_missed,
    )
    yield _histogram(
        "epd_pd_step_time_prediction_ratio",
        "Measured / predicted step duration",
        PREDICTION_RATIO_BUCKETS,
        budget.ratio_bucket_counts,
        budget.ratio_sum,
    )


def _histogram(
    name: str, documentation: str, bounds: Sequence[float], cumulative_counts: Sequence[int], total: float
) -> HistogramMetricFamily:
    """A histogram family from a snapshot's cumulative counts per bound (then +Inf) and sum."""
    labels = [repr(float(bound)) for bound in bounds] + ["+Inf"]
    return HistogramMetricFamily(name, documentation, buckets=list(zip(labels, cumulative_counts)), sum_value=total)

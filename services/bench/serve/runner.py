"""The measuring loop of ``epd bench serve``: configurations x rates x repeats, one cluster at a time.

Each configuration's cluster is started once per repeat, warmed up, then
driven at every rate in turn; repeats rotate the order of configurations so
that slow drift of a shared machine does not always land on the same one.
The first cluster started also calibrates: lone requests give the step time
the default SLO is derived from, and (without ``--rates``) a burst gives
the capacity the automatic rate sweep is centred on.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.bench.serve.client import run_schedule, run_sequential
from services.bench.serve.layout import Topology
from services.bench.serve.procs import Cluster, ServiceArgs
from services.bench.serve.stats import RequestRecord, Slo
from services.bench.serve.workload import (
    CALIBRATION_RUN,
    WARMUP_RUN,
    encode_bodies,
    lone_requests,
    make_requests,
    poisson_arrivals,
    warmup_requests,
)


@dataclass(frozen=True)
class RunPlan:
    """What to send (workload side of the command line)."""

    workload: str
    num_requests: int
    max_tokens: int
    prompt_words: int
    seed: int
    image_size: int
    images_first: bool = False  # images before the text in each message
    long_words: tuple[int, int] | None = None  # long prompts' word range (None = the workload's)
    rates: tuple[float, ...] = ()  # empty = automatic sweep
    rate_multipliers: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0)
    repeats: int = 1
    slo_ttft_ms: float = 0.0  # 0 = derived
    slo_tpot_ms: float = 0.0
    slo_factor: float = 3.0
    calibration_requests: int = 3
    burst_requests: int = 24
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    progress: bool = True


@dataclass
class ConfigResult:
    """One configuration's raw outcome: its processes, every run, or why it failed."""

    topology: Topology
    processes: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # rate, repeat, load averages
    records: dict[float, list[RequestRecord]] = field(default_factory=dict)  # pooled over repeats
    error: str | None = None


def _median_ms(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) * 1000 if present else None


def _round_rate(rate: float) -> float:
    return float(f"{rate:.3g}")


class Runner:
    """Runs the whole plan; ``results`` and ``calibration`` hold what it measured."""

    def __init__(
        self,
        plan: RunPlan,
        topologies: dict[str, Topology],
        service: ServiceArgs,
        log_dir: Path,
        cluster_factory: Callable[[Topology, ServiceArgs, Path], Cluster] = Cluster,
    ) -> None:
        self.plan = plan
        self._cluster_factory = cluster_factory
        self.topologies = topologies
        self.service = service
        self.log_dir = log_dir
        self.results = {name: ConfigResult(topology) for name, topology in topologies.items()}
        self.rates: list[float] = sorted(plan.rates)
        self.rates_source = "given with --rates" if plan.rates else ""
        self.slo: Slo | None = (
            Slo(plan.slo_ttft_ms, plan.slo_tpot_ms) if plan.slo_ttft_ms and plan.slo_tpot_ms else None
        )
        self.calibration: dict[str, Any] = {}
        self._bar: Any = None

    # ------------------------------------------------------------------ top level

    def run(self) -> None:
        names = list(self.topologies)
        try:
            for repeat in range(self.plan.repeats):
                shift = repeat % len(names)
                for name in names[shift:] + names[:shift]:
                    self._run_config(name, repeat)
        finally:
            if self._bar is not None:
                self._bar.close()

    def _run_config(self, name: str, repeat: int) -> None:
        result = self.results[name]
        if result.error:
            return
        cluster = self._cluster_factory(result.topology, self.service, self.log_dir)
        _say(f"[{name}] starting {len(result.topology.processes)} processes (repeat {repeat + 1}/{self.plan.repeats})")
        try:
            cluster.start()
            result.processes = cluster.describe()
            started = time.monotonic()
            asyncio.run(cluster.wait_ready(self.plan.startup_timeout_s))
            _say(f"[{name}] ready in {time.monotonic() - started:.1f}s")
            urls = cluster.proxy_urls
            self._warm_up(urls)
            if self.slo is None or not self.rates:
                self._calibrate(name, urls)
            for index, rate in enumerate(self.rates):
                self._measure(name, urls, repeat, index, rate)
                dead = cluster.exited()
                if dead:
                    raise RuntimeError(f"process(es) exited during the run: {', '.join(dead)}")
        except (RuntimeError, TimeoutError, OSError) as error:
            result.error = str(error)
            _say(f"[{name}] FAILED: {error}")
        finally:
            codes = cluster.stop()
            _say(f"[{name}] stopped (exit codes {codes})")

    # ------------------------------------------------------------------ phases

    def _specs(self, workload: str, count: int, run: int):
        p = self.plan
        return make_requests(
            workload,
            count,
            seed=p.seed,
            run=run,
            image_size=p.image_size,
            prompt_words=p.prompt_words,
            max_tokens=p.max_tokens,
            long_words=p.long_words,
        )

    def _bodies(self, specs) -> list[bytes]:
        return encode_bodies(specs, images_first=self.plan.images_first)

    def _warm_up(self, urls: list[str]) -> None:
        """One request of each kind the workload sends (untimed): first-call costs stay out of the measurement."""
        p = self.plan
        specs = warmup_requests(
            p.workload,
            seed=p.seed,
            run=WARMUP_RUN,
            image_size=p.image_size,
            prompt_words=p.prompt_words,
            max_tokens=min(p.max_tokens, 8),
            long_words=p.long_words,
        )
        done = asyncio.run(run_sequential(urls, specs, self._bodies(specs), request_timeout_s=p.request_timeout_s))
        failed = [f"{r.kind}: {r.error}" for r in done if not r.ok]
        if failed:
            # A configuration that cannot serve one request of each kind is broken, not slow.
            raise RuntimeError(f"warm-up requests failed ({'; '.join(failed)})")

    def _calibrate(self, name: str, urls: list[str]) -> None:
        p = self.plan
        texts, heavy = lone_requests(
            p.workload,
            p.calibration_requests,
            seed=p.seed,
            run=CALIBRATION_RUN,
            image_size=p.image_size,
            prompt_words=p.prompt_words,
            max_tokens=p.max_tokens,
            long_words=p.long_words,
        )
        lone = asyncio.run(
            run_sequential(urls, texts + heavy, self._bodies(texts + heavy), request_timeout_s=p.request_timeout_s)
        )
        lone_text, lone_heavy = lone[: len(texts)], lone[len(texts) :]
        if not all(r.ok for r in lone):
            # A request that is not ok without an error streamed no token (see RequestRecord.ok).
            raise RuntimeError(
                f"calibration requests failed: {sorted({r.error or 'no tokens' for r in lone if not r.ok})}"
            )
        step_ms = _median_ms([r.tpot for r in lone_text])
        ttft_ms = _median_ms([r.ttft for r in (lone_heavy or lone_text)])
        if step_ms is None or ttft_ms is None:
            raise RuntimeError("calibration measured no TPOT or TTFT: no lone text request streamed two tokens")
        heavy_what = _describe_heavy(heavy)
        self.calibration = {
            "config": name,
            "step_ms": step_ms,
            "lone_ttft_ms": ttft_ms,
            "lone_ttft_of": heavy_what,
            "lone_text_ttft_ms": _median_ms([r.ttft for r in lone_text]),
        }
        if self.slo is None:
            f = p.slo_factor
            ttft_why = (
                f"given ({p.slo_ttft_ms:g} ms)"
                if p.slo_ttft_ms
                else f"{f:g} x {ttft_ms:.1f} ms (median TTFT of {heavy_what})"
            )
            tpot_why = (
                f"given ({p.slo_tpot_ms:g} ms)"
                if p.slo_tpot_ms
                else f"{f:g} x {step_ms:.1f} ms (median TPOT of a lone text request = one decode step)"
            )
            self.slo = Slo(
                ttft_ms=p.slo_ttft_ms or round(f * ttft_ms, 1),
                tpot_ms=p.slo_tpot_ms or round(f * step_ms, 1),
                derivation=f"Derived on {name}, unloaded: p99 TTFT limit = {ttft_why}; p99 TPOT limit = {tpot_why}.",
            )
        _say(
            f"[{name}] calibration: step {step_ms:.1f} ms, lone TTFT {ttft_ms:.1f} ms ({heavy_what}); "
            f"SLO p99 TTFT <= {self.slo.ttft_ms:.1f} ms, p99 TPOT <= {self.slo.tpot_ms:.1f} ms"
        )
        if not self.rates:
            self._calibrate_rates(name, urls)

    def _calibrate_rates(self, name: str, urls: list[str]) -> None:
        """All of a burst at once: completed / makespan is the capacity the sweep is centred on."""
        p = self.plan
        specs = self._specs(p.workload, p.burst_requests, CALIBRATION_RUN + 1)
        burst = asyncio.run(
            run_schedule(urls, specs, self._bodies(specs), [0.0] * len(specs), request_timeout_s=p.request_timeout_s)
        )
        ok = [r for r in burst if r.ok]
        makespan = max((r.start_s + r.e2e for r in ok), default=0.0)
        if not ok or makespan <= 0:
            raise RuntimeError("the capacity burst completed no request")
        capacity = len(ok) / makespan
        self.rates = sorted({_round_rate(capacity * m) for m in p.rate_multipliers if capacity * m > 0})
        self.calibration["burst_capacity_rps"] = round(capacity, 4)
        self.rates_source = (
            f"automatic: {', '.join(f'{m:g}' for m in p.rate_multipliers)} x the capacity "
            f"{capacity:.3g} req/s measured on {name} with a burst of {p.burst_requests} requests"
        )
        _say(f"[{name}] burst capacity {capacity:.3g} req/s -> rates {self.rates}")

    def _measure(self, name: str, urls: list[str], repeat: int, index: int, rate: float) -> None:
        p = self.plan
        # The same run number on every configuration: the same requests, the same images.
        specs = self._specs(p.workload, p.num_requests, repeat * 1000 + index)
        bodies = self._bodies(specs)
        arrivals = poisson_arrivals(len(specs), rate, seed=p.seed + repeat)
        bar = self._progress()
        if bar is not None:
            bar.set_description(f"{name} @ {rate:g} req/s")
        load_before = os.getloadavg()
        records = asyncio.run(
            run_schedule(
                urls,
                specs,
                bodies,
                arrivals,
                request_timeout_s=p.request_timeout_s,
                on_done=(lambda _: bar.update(1)) if bar is not None else None,
            )
        )
        result = self.results[name]
        result.records.setdefault(rate, []).extend(records)
        failed = sum(1 for r in records if not r.ok)
        result.runs.append(
            {
                "rate": rate,
                "repeat": repeat,
                "num_failed": failed,
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
            }
        )
        if failed:
            _say(f"[{name}] {failed} of {len(records)} requests failed at {rate:g} req/s")

    def _progress(self) -> Any:
        if self._bar is None and self.plan.progress:
            from tqdm import tqdm

            total = self.plan.repeats * len(self.topologies) * len(self.rates) * self.plan.num_requests
            self._bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
        return self._bar


def _describe_heavy(heavy: list) -> str:
    """What the SLO's TTFT reference request is, for the report."""
    if not heavy:
        return "a lone text request"
    if heavy[0].images:
        return f"a lone request with {len(heavy[0].images)} images"
    return f"a lone {len(heavy[0].prompt.split())}-word text request (the workload's longest prompt)"


def _say(message: str) -> None:
    """A status line on stderr that does not tear the progress bar."""
    from tqdm import tqdm

    tqdm.write(f"epd bench serve: {message}", file=sys.stderr)

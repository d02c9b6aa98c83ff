"""Side-by-side analysis of ``epd bench serve``: ratios to (c), goodput, the issue's targets (pure).

Input: ``by_rate[config][rate] = summarize_run(...)`` for the configurations
that ran. Ratios are ``config / disagg`` (above 1 for a latency: the
baseline is slower than disaggregation; for (d) E+P+D, below 1 means E+P+D
is faster than E+PD). Targets are checked at one rate: the swept rate
nearest to the colocated baseline's saturation (its highest achieved request
throughput, or the first configuration's that ran), which is where the stall
matters most.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.bench.serve.stats import (
    Slo,
    goodput,
    nearest_rate,
    ratio,
    saturation_rate,
    stat,
)

RATIO_METRICS = (
    ("request_throughput", None, None, None),
    ("output_token_throughput", None, None, None),
    ("ttft_mean_all", "all", "ttft", "mean"),
    ("ttft_p99_all", "all", "ttft", "p99"),
    ("ttft_mean_text", "text", "ttft", "mean"),
    ("ttft_p99_text", "text", "ttft", "p99"),
    ("ttft_mean_long", "long", "ttft", "mean"),
    ("ttft_mean_image", "image", "ttft", "mean"),
    ("tpot_mean_all", "all", "tpot", "mean"),
    ("tpot_p99_all", "all", "tpot", "p99"),
    ("itl_p99_all", "all", "itl", "p99"),
    ("itl_p99_text", "text", "itl", "p99"),
    ("e2e_mean_all", "all", "e2e", "mean"),
)
"""(name, group, metric, statistic); a None group means a top-level summary field."""


def metric(summary: dict[str, Any], name: str) -> float | None:
    """One of ``RATIO_METRICS`` out of a run summary."""
    for key, group, what, statistic in RATIO_METRICS:
        if key == name:
            if group is None or what is None or statistic is None:  # all three or none (a summary field)
                return summary.get(key)
            return stat(summary, group, what, statistic)
    raise KeyError(name)


def ratios_to_disagg(by_rate: dict[str, dict[float, dict[str, Any]]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """``ratios[config][rate][metric] = config's value / disagg's value`` at each rate both ran."""
    reference = by_rate.get("disagg")
    if not reference:
        return {}
    ratios: dict[str, dict[str, dict[str, float | None]]] = {}
    for config, runs in by_rate.items():
        if config == "disagg":
            continue
        ratios[config] = {
            f"{rate:g}": {
                name: ratio(metric(runs[rate], name), metric(reference[rate], name)) for name, *_ in RATIO_METRICS
            }
            for rate in sorted(runs)
            if rate in reference
        }
    return ratios


def goodputs(by_rate: dict[str, dict[float, dict[str, Any]]], slo: Slo) -> dict[str, dict[str, Any]]:
    return {config: goodput(runs, slo) for config, runs in by_rate.items()}


def target_rate(by_rate: dict[str, dict[float, dict[str, Any]]]) -> tuple[float | None, str]:
    """The rate targets are checked at, and why."""
    for baseline in ("colocated", "replicas", "disagg", "epd"):
        runs = by_rate.get(baseline)
        if not runs:
            continue
        saturation = saturation_rate(runs)
        if saturation:
            rate = nearest_rate(sorted(runs), saturation)
            return rate, (
                f"{rate:g} req/s: the swept rate nearest to {baseline}'s saturation "
                f"(its highest achieved throughput, {saturation:g} req/s)"
            )
    return None, "no configuration completed a run"


@dataclass(frozen=True)
class Target:
    """One check of the issue: ``value <= limit`` (or ``>=``) met or missed; None = could not be measured."""

    name: str
    value: float | None
    limit: float
    higher_is_better: bool = False
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.limit if self.higher_is_better else self.value <= self.limit

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "limit": self.limit,
            "comparison": ">=" if self.higher_is_better else "<=",
            "met": self.met,
            "note": self.note,
        }


def _at(by_rate: dict, config: str, rate: float | None) -> dict[str, Any]:
    return by_rate.get(config, {}).get(rate, {}) if rate is not None else {}


def _goodput_target(good: dict[str, dict[str, Any]]) -> Target:
    baselines = [good[c]["rate"] for c in ("colocated", "replicas") if c in good]
    best = max(baselines) if baselines else None
    value = ratio(good["disagg"]["rate"], best) if "disagg" in good and best is not None else None
    note = "lower bound: (c) met the SLO at the highest swept rate" if good.get("disagg", {}).get("lower_bound") else ""
    if best == 0 and "disagg" in good:
        note = (
            f"no baseline met the SLO at any swept rate ((c): {good['disagg']['rate']:g} req/s); "
            "sweep lower rates to get a ratio"
        )
    return Target("goodput (c) / max((a), (b))", value, 1.5, higher_is_better=True, note=note)


def evaluate_targets(
    workload: str, by_rate: dict[str, dict[float, dict[str, Any]]], good: dict[str, dict[str, Any]], rate: float | None
) -> list[Target]:
    """The issue's targets for ``workload`` (``text`` has none: it reports costs)."""
    a, b, c = (_at(by_rate, name, rate) for name in ("colocated", "replicas", "disagg"))

    def ratio_of(group: str, what: str, statistic: str, base: dict[str, Any]) -> float | None:
        return ratio(stat(c, group, what, statistic), stat(base, group, what, statistic)) if c and base else None

    if workload == "mixed":
        return [
            Target("p99 ITL of text requests, (c) / (a)", ratio_of("text", "itl", "p99", a), 0.3),
            Target("p99 ITL of text requests, (c) / (b)", ratio_of("text", "itl", "p99", b), 0.5),
            Target("mean TTFT of text requests, (c) / (a)", ratio_of("text", "ttft", "mean", a), 0.5),
            _goodput_target(good),
        ]
    if workload == "long-mixed":
        return _epd_targets(by_rate, good, rate)
    if workload == "multi-image":
        return [_goodput_target(good)]
    if workload == "repeat":
        return [
            Target(
                f"mean TTFT repeated / first-seen images, {name}",
                ratio(stat(s, "repeated", "ttft", "mean"), stat(s, "first_seen", "ttft", "mean")),
                0.5,
            )
            for name, s in (("(c)", c), ("(a)", a), ("(b)", b))
            if s
        ]
    return []


def _epd_targets(
    by_rate: dict[str, dict[float, dict[str, Any]]], good: dict[str, dict[str, Any]], rate: float | None
) -> list[Target]:
    """(d) E+P+D against (c) E+PD on the same cores: a win is a ratio below 1 (goodput: above 1).

    The issue sets no threshold; what E+P+D removes is the prefill of long
    prompts between the decode steps of short text streams, so their p99 ITL
    is the headline figure, and their TTFT and the goodput say what it costs.
    """
    c, d = _at(by_rate, "disagg", rate), _at(by_rate, "epd", rate)

    def ratio_of(group: str, what: str, statistic: str) -> float | None:
        return ratio(stat(d, group, what, statistic), stat(c, group, what, statistic)) if c and d else None

    win = "below 1: E+P+D is faster"
    good_value = ratio(good["epd"]["rate"], good["disagg"]["rate"]) if {"epd", "disagg"} <= set(good) else None
    good_note = "above 1: E+P+D holds the SLO at a higher rate"
    if good_value is None and {"epd", "disagg"} <= set(good):
        good_note = f"(c) met the SLO at no swept rate ((d): {good['epd']['rate']:g} req/s); sweep lower rates"
    return [
        Target("p99 ITL of short text requests, (d) / (c)", ratio_of("text", "itl", "p99"), 1.0, note=win),
        Target("mean TTFT of short text requests, (d) / (c)", ratio_of("text", "ttft", "mean"), 1.0, note=win),
        Target("p99 TTFT of all requests, (d) / (c)", ratio_of("all", "ttft", "p99"), 1.0, note=win),
        Target("goodput (d) / (c)", good_value, 1.0, higher_is_better=True, note=good_note),
    ]


def analyze(workload: str, by_rate: dict[str, dict[float, dict[str, Any]]], slo: Slo) -> dict[str, Any]:
    """Everything the report shows beside the raw tables."""
    good = goodputs(by_rate, slo)
    rate, why = target_rate(by_rate)
    return {
        "goodput": good,
        "ratios_to_disagg": ratios_to_disagg(by_rate),
        "target_rate": rate,
        "target_rate_reason": why,
        "targets": [t.to_json() for t in evaluate_targets(workload, by_rate, good, rate)],
    }

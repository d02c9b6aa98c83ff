"""Statistics of ``epd bench serve``: per-request records, latency summaries, goodput, ratios.

Pure Python (no numpy, no I/O) so that it is cheap to test. Times inside a
record are seconds; summaries report milliseconds.

Definitions (the ones vLLM's ``benchmark_serving`` uses, per request):

- TTFT: send -> first chunk carrying a generated token.
- TPOT: ``(e2e - ttft) / (num_tokens - 1)``, requests with >= 2 tokens only.
- ITL: the gap before each token after the first. Tokens that arrive in one
  SSE chunk share its arrival time, so such a chunk contributes one real gap
  and zeros (what the client saw; nothing is spread out artificially).
- E2E: send -> end of the stream.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
METRICS = ("ttft", "tpot", "itl", "e2e")
GROUPS = ("all", "text", "long", "image", "first_seen", "repeated")
"""``text``: short text prompts (with ``long``, the long ones, in ``long-mixed``); ``first_seen`` /
``repeated``: image requests none / all of whose images were sent before in the run."""


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    index: int
    kind: str  # "text" (short prompt) | "long" (long text prompt) | "image"
    num_images: int
    image_class: str | None  # "first_seen" | "repeated" | "partial" | None (text)
    scheduled_s: float  # arrival time in the schedule, seconds after the run started
    start_s: float = 0.0  # when it was actually sent, seconds after the run started
    token_times_s: list[float] = field(default_factory=list)  # one per generated token, seconds after send
    end_s: float | None = None  # end of the stream, seconds after send
    prompt_tokens: int = 0
    error: str | None = None  # short reason (HTTP status, error type); never request content
    target: str = ""  # proxy URL it was sent to
    # Where the server says the request's time went (``usage.epd.timings_ms`` of an ``epd`` proxy: preprocess,
    # preallocate, encode, queue, embedding_wait, prefill, first_token, ...); empty for other servers.
    stages_ms: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times_s) and self.end_s is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft(self) -> float:
        return self.token_times_s[0]

    @property
    def e2e(self) -> float:
        assert self.end_s is not None
        return self.end_s

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.token_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    def in_group(self, group: str) -> bool:
        if group == "all":
            return True
        if group in ("text", "long", "image"):
            return self.kind == group
        return self.image_class == group

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "num_images": self.num_images,
            "image_class": self.image_class,
            "scheduled_s": round(self.scheduled_s, 6),
            "start_s": round(self.start_s, 6),
            "token_times_s": [round(t, 6) for t in self.token_times_s],
            "end_s": None if self.end_s is None else round(self.end_s, 6),
            "prompt_tokens": self.prompt_tokens,
            "error": self.error,
            "target": self.target,
            "stages_ms": self.stages_ms,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linear between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be within [0, 100]")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values_s: Iterable[float]) -> dict[str, Any]:
    """``{n, mean, median, p90, p99}`` in milliseconds; ``None`` statistics when there are no values."""
    values = [v * 1000.0 for v in values_s]
    summary: dict[str, Any] = {"n": len(values), "mean": _round(sum(values) / len(values)) if values else None}
    for name, q in PERCENTILES:
        summary[name] = _round(percentile(values, q)) if values else None
    return summary


def _round(value: float) -> float:
    return round(value, 3)


def metric_values(records: Iterable[RequestRecord], metric: str) -> list[float]:
    """Seconds: one value per successful request (per token for ``itl``)."""
    ok = [r for r in records if r.ok]
    if metric == "ttft":
        return [r.ttft for r in ok]
    if metric == "e2e":
        return [r.e2e for r in ok]
    if metric == "tpot":
        return [t for t in (r.tpot for r in ok) if t is not None]
    if metric == "itl":
        return [gap for r in ok for gap in r.itls]
    raise ValueError(f"unknown metric {metric!r}")


def summarize_run(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Throughput, failures and per-group latency summaries of one run at one rate."""
    ok = [r for r in records if r.ok]
    duration = _duration(records)
    output_tokens = sum(r.num_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    groups = {}
    for group in GROUPS:
        members = [r for r in records if r.in_group(group)]
        if not members or (group in ("first_seen", "repeated") and not _has_repeats(records)):
            continue
        groups[group] = {"num_requests": len(members), **{m: summarize(metric_values(members, m)) for m in METRICS}}
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "errors": dict(Counter(r.error or "no tokens" for r in records if not r.ok).most_common(5)),
        "duration_s": _round(duration),
        "request_throughput": _round(len(ok) / duration) if duration > 0 else None,
        "output_token_throughput": _round(output_tokens / duration) if duration > 0 else None,
        "total_token_throughput": _round((output_tokens + prompt_tokens) / duration) if duration > 0 else None,
        "groups": groups,
    }


def _has_repeats(records: Sequence[RequestRecord]) -> bool:
    return any(r.image_class == "repeated" for r in records)


def _duration(records: Sequence[RequestRecord]) -> float:
    """First send to last stream end (failed requests count until they failed)."""
    if not records:
        return 0.0
    ends = [r.start_s + r.end_s for r in records if r.end_s is not None]
    return max(ends, default=0.0) - min(r.start_s for r in records)


def stat(summary: dict[str, Any], group: str, metric: str, name: str) -> float | None:
    """One number out of a run summary, e.g. ``stat(s, "text", "itl", "p99")``; None when absent."""
    return summary.get("groups", {}).get(group, {}).get(metric, {}).get(name)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return round(numerator / denominator, 4)


@dataclass(frozen=True)
class Slo:
    """Goodput's service-level objective: p99 TTFT and p99 TPOT limits, milliseconds."""

    ttft_ms: float
    tpot_ms: float
    derivation: str = "given on the command line"


def meets_slo(summary: dict[str, Any], slo: Slo) -> bool:
    """All requests succeeded, and p99 TTFT and p99 TPOT (all requests) are within the SLO."""
    ttft = stat(summary, "all", "ttft", "p99")
    tpot = stat(summary, "all", "tpot", "p99")
    return (
        summary.get("num_failed", 1) == 0
        and ttft is not None
        and ttft <= slo.ttft_ms
        and tpot is not None
        and tpot <= slo.tpot_ms
    )


def goodput(summaries_by_rate: dict[float, dict[str, Any]], slo: Slo) -> dict[str, Any]:
    """Highest swept rate at which the SLO holds at that rate and every lower one.

    ``lower_bound`` is True when even the highest swept rate met the SLO (the
    real goodput may be higher); the value is 0.0 when the lowest rate misses.
    """
    rates = sorted(summaries_by_rate)
    passed = {rate: meets_slo(summaries_by_rate[rate], slo) for rate in rates}
    best = 0.0
    for rate in rates:
        if not passed[rate]:
            break
        best = rate
    return {
        "rate": best,
        "lower_bound": bool(rates) and best == rates[-1],
        "passed": {_key(rate): ok for rate, ok in passed.items()},
    }


def _key(rate: float) -> str:
    return f"{rate:g}"


def nearest_rate(rates: Sequence[float], target: float) -> float:
    """The swept rate closest to ``target`` on a log scale (rates are multiplicative)."""
    if not rates or target <= 0:
        raise ValueError("need rates and a positive target")
    return min(rates, key=lambda r: abs(math.log(r / target)))


def saturation_rate(summaries_by_rate: dict[float, dict[str, Any]]) -> float | None:
    """Highest achieved request throughput over the sweep (what the configuration can sustain)."""
    values = [s["request_throughput"] for s in summaries_by_rate.values() if s.get("request_throughput")]
    return max(values) if values else None

"""PNG plots of ``epd bench serve`` (matplotlib, ``pip install 'epd-cluster[bench]'``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.bench.serve.stats import RequestRecord, Slo, metric_values, stat

COLORS = {"colocated": "tab:red", "replicas": "tab:orange", "disagg": "tab:blue", "epd": "tab:green"}
LOG_FLOOR_MS = 0.01
SHORT = {"colocated": "(a) colocated", "replicas": "(b) replicas", "disagg": "(c) disaggregated", "epd": "(d) E+P+D"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(path: Path, records: Mapping[str, Sequence[RequestRecord]], rate: float, workload: str) -> Path:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) of each configuration at one rate."""
    plt = _pyplot()
    # With other kinds beside short text (images, long prompts), the ITL panel shows the short text
    # streams alone: theirs is the stall the other kinds' prefills cause.
    mixed = any(r.kind == "text" for rs in records.values() for r in rs) and any(
        r.kind != "text" for rs in records.values() for r in rs
    )
    panels = [
        ("ttft", "TTFT", None),
        ("tpot", "TPOT", None),
        ("itl", "inter-token latency" + (" (short text requests)" if mixed else ""), "text" if mixed else None),
        ("e2e", "end-to-end latency", None),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (what, title, kind) in zip(axes.flat, panels):
        for config, rs in records.items():
            chosen = [r for r in rs if kind is None or r.kind == kind]
            # Log axis: tails span orders of magnitude. Tokens that shared a chunk
            # (gap 0) are drawn at the floor rather than dropped.
            values = sorted(max(v * 1000, LOG_FLOOR_MS) for v in metric_values(chosen, what))
            if values:
                fractions = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
                axis.step(
                    [values[0], *values],
                    fractions,
                    where="post",
                    color=COLORS.get(config),
                    label=SHORT.get(config, config),
                )
        axis.set_title(title)
        axis.set_xscale("log")
        axis.set_xlabel("ms (log)" + (f"; 0 drawn at {LOG_FLOOR_MS:g}" if what == "itl" else ""))
        axis.set_ylabel("fraction of " + ("tokens" if what == "itl" else "requests"))
        axis.grid(alpha=0.3)
        axis.legend(loc="lower right", fontsize=8)
    figure.suptitle(f"epd bench serve: {workload} at {rate:g} req/s")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_rates(path: Path, by_rate: dict[str, dict[float, dict[str, Any]]], slo: Slo, workload: str) -> Path:
    """p99 and mean TTFT and TPOT, and achieved throughput, against the offered request rate."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("ttft", "TTFT (ms)", slo.ttft_ms), ("tpot", "TPOT (ms)", slo.tpot_ms)]
    for axis, (what, label, limit) in zip(axes, panels):
        for config, runs in by_rate.items():
            rates = sorted(runs)
            for statistic, style in (("p99", "-o"), ("mean", "--")):
                values = [stat(runs[r], "all", what, statistic) for r in rates]
                axis.plot(
                    rates,
                    [float("nan") if v is None else v for v in values],
                    style,
                    color=COLORS.get(config),
                    label=f"{SHORT.get(config, config)} {statistic}",
                )
        axis.axhline(limit, color="black", linestyle=":", label=f"SLO (p99) {limit:g} ms")
        axis.set_xlabel("offered request rate (req/s)")
        axis.set_ylabel(label)
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    axis = axes[2]
    for config, runs in by_rate.items():
        rates = sorted(runs)
        axis.plot(
            rates,
            [runs[r].get("request_throughput") or float("nan") for r in rates],
            "-o",
            color=COLORS.get(config),
            label=SHORT.get(config, config),
        )
    top = max((r for runs in by_rate.values() for r in runs), default=1.0)
    axis.plot([0, top], [0, top], ":", color="gray", label="offered")
    axis.set_xlabel("offered request rate (req/s)")
    axis.set_ylabel("achieved request throughput (req/s)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.suptitle(f"epd bench serve: {workload}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

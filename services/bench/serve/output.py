"""Writes what ``epd bench serve`` measured: results.json, requests.jsonl, results.md, PNG plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from services.bench.serve.analysis import analyze
from services.bench.serve.report import render_markdown
from services.bench.serve.runner import Runner
from services.bench.serve.stats import Slo, summarize_run
from services.bench.serve.workload import WORKLOADS

SCHEMA = "epd-bench-serve/1"


def build_results(runner: Runner, context: dict[str, Any]) -> dict[str, Any]:
    """The JSON document (every number the report shows, and the settings that produced them)."""
    plan = runner.plan
    slo = runner.slo or Slo(0.0, 0.0, "not derived: no configuration completed calibration")
    by_rate = {
        name: {rate: summarize_run(records) for rate, records in sorted(result.records.items())}
        for name, result in runner.results.items()
        if result.records
    }
    configs = {}
    for name, result in runner.results.items():
        configs[name] = {
            "label": result.topology.label,
            "notes": list(result.topology.notes),
            "processes": result.processes,
            "error": result.error,
            "runs": result.runs,
            "by_rate": {f"{rate:g}": summary for rate, summary in by_rate.get(name, {}).items()},
        }
    return {
        "schema": SCHEMA,
        "command": context["command"],
        "machine": context["machine"],
        "load_average": context["load_average"],
        "model": context["model"],
        "service_args": context["service_args"],
        "workload": {
            "name": plan.workload,
            "description": WORKLOADS[plan.workload].description,
            "num_requests": plan.num_requests,
            "max_tokens": plan.max_tokens,
            "prompt_words": plan.prompt_words,
            "seed": plan.seed,
            "repeats": plan.repeats,
            "images_first": plan.images_first,
            **_long_words(plan.workload, plan.long_words),
        },
        "plan": context["plan"],
        "rates": runner.rates,
        "rates_source": runner.rates_source,
        "calibration": runner.calibration,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "derivation": slo.derivation},
        "configs": configs,
        "analysis": analyze(plan.workload, by_rate, slo),
    }


def _long_words(workload: str, given: tuple[int, int] | None) -> dict[str, Any]:
    """The long prompts' word range, for a workload that has long prompts."""
    shape = WORKLOADS[workload]
    return {"long_prompt_words": list(given or shape.long_words)} if shape.long_fraction else {}


def _write_requests(path: Path, runner: Runner) -> None:
    with open(path, "w") as file:
        for name, result in runner.results.items():
            for rate, records in sorted(result.records.items()):
                for record in records:
                    file.write(json.dumps({"config": name, "rate": rate, **record.to_json()}) + "\n")


def _plots(out_dir: Path, runner: Runner, results: dict[str, Any]) -> dict[str, str]:
    """Writes the PNGs; returns {title: file name}. Missing matplotlib is reported, not fatal."""
    from services.bench.serve.plots import plot_cdfs, plot_rates

    workload = runner.plan.workload
    slo = Slo(results["slo"]["ttft_ms"], results["slo"]["tpot_ms"])
    by_rate = {
        name: {float(key): summary for key, summary in config["by_rate"].items()}
        for name, config in results["configs"].items()
        if config["by_rate"]
    }
    plots: dict[str, str] = {}
    try:
        rate = results["analysis"]["target_rate"]
        if rate is not None:
            records = {name: result.records[rate] for name, result in runner.results.items() if rate in result.records}
            plots["latency CDFs"] = plot_cdfs(out_dir / f"cdf-{workload}.png", records, rate, workload).name
        if by_rate:
            plots["TTFT and TPOT vs request rate"] = plot_rates(
                out_dir / f"rates-{workload}.png", by_rate, slo, workload
            ).name
    except ImportError:  # matplotlib is an optional extra
        print(
            "epd bench serve: matplotlib is not installed; no plots (pip install 'epd-cluster[bench]')", file=sys.stderr
        )
    return plots


def write_outputs(out_dir: Path, runner: Runner, context: dict[str, Any], *, plots: bool = True) -> str:
    """Writes every output file; returns a short summary for the terminal."""
    results = build_results(runner, context)
    results["plots"] = _plots(out_dir, runner, results) if plots else {}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _write_requests(out_dir / "requests.jsonl", runner)
    markdown = render_markdown(results)
    (out_dir / "results.md").write_text(markdown + "\n")
    lines = [
        f"epd bench serve: wrote {out_dir}/results.json, results.md, requests.jsonl"
        + "".join(f", {name}" for name in results["plots"].values())
    ]
    # The terminal gets the comparison part of the report (from the goodput table on).
    start = markdown.find("## Ratios")
    lines.append(markdown[start:] if start >= 0 else markdown)
    return "\n".join(lines)

"""``results.md`` of ``epd bench serve``: the JSON results as tables a reader can compare at a glance."""

from __future__ import annotations

from typing import Any

from services.bench.serve.analysis import RATIO_METRICS
from services.bench.serve.stats import stat

LATENCY_COLUMNS = ("mean", "median", "p90", "p99")


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table, then a blank line."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _setup(results: dict[str, Any]) -> list[str]:
    machine, model, workload, slo = results["machine"], results["model"], results["workload"], results["slo"]
    load = results.get("load_average", {})
    return [
        f"# epd bench serve: workload `{workload['name']}`",
        "",
        f"Command: `{results['command']}`",
        "",
        (
            f"- Machine: {machine['cpu']}, {machine['num_cpus']} CPUs, benchmark cores {machine['cores']}; "
            f"{machine['platform']}; torch {machine['torch']}; load average before {load.get('before')}, "
            f"after {load.get('after')}"
        ),
        f"- Model: `{model['path']}` (image size {model['image_size']} px)",
        (
            f"- Workload: {workload['description']}; {workload['num_requests']} requests per rate and repeat, "
            f"prompt {workload['prompt_words']} words{' after the images' if workload.get('images_first') else ''}"
            f"{_long_prompts(workload)}, "
            f"{workload['max_tokens']} output tokens (ignore_eos), seed {workload['seed']}, {workload['repeats']} repeat(s)"
        ),
        f"- Rates (req/s): {', '.join(f'{r:g}' for r in results['rates'])} ({results['rates_source']})",
        (
            f"- SLO for goodput: p99 TTFT <= {slo['ttft_ms']:.1f} ms and p99 TPOT <= {slo['tpot_ms']:.1f} ms, "
            f"no failed request. {slo['derivation']}"
        ),
        "",
    ]


def _long_prompts(workload: dict[str, Any]) -> str:
    words = workload.get("long_prompt_words")
    return f" (long prompts {words[0]}-{words[1]} words)" if words else ""


def _layout(results: dict[str, Any]) -> list[str]:
    lines = ["## Configurations", ""]
    rows = []
    for config in results["configs"].values():
        for process in config.get("processes", []):
            rows.append(
                [
                    config["label"],
                    process["name"],
                    ",".join(map(str, process["cores"])),
                    str(process["threads"]),
                    ",".join(map(str, process["measured_affinity"])),
                ]
            )
    lines += markdown_table(["configuration", "process", "cores", "threads", "affinity seen"], rows)
    for name, config in results["configs"].items():
        for note in config.get("notes", []):
            lines.append(f"- {name}: {note}")
        if config.get("error"):
            lines.append(f"- {name}: **failed**: {config['error']}")
    return lines + [""]


def _latency_cells(summary: dict[str, Any], group: str, metric: str) -> list[str]:
    return [_num(stat(summary, group, metric, c)) for c in LATENCY_COLUMNS]


def _per_rate(results: dict[str, Any]) -> list[str]:
    lines = ["## Results per rate (all requests; latencies in ms: mean / median / p90 / p99)", ""]
    header = ["config", "rate", "req/s", "tok/s", "failed", "TTFT", "TPOT", "ITL", "E2E"]
    rows = []
    for name, config in results["configs"].items():
        for key, summary in config.get("by_rate", {}).items():
            rows.append(
                [
                    name,
                    key,
                    _num(summary.get("request_throughput"), 2),
                    _num(summary.get("output_token_throughput")),
                    str(summary.get("num_failed")),
                    *[" / ".join(_latency_cells(summary, "all", m)) for m in ("ttft", "tpot", "itl", "e2e")],
                ]
            )
    return lines + markdown_table(header, rows)


def _groups_at_target(results: dict[str, Any]) -> list[str]:
    rate = results["analysis"]["target_rate"]
    if rate is None:
        return []
    key = f"{rate:g}"
    lines = [f"## By request kind at {results['analysis']['target_rate_reason']}", ""]
    header = ["config", "requests", "n", "TTFT", "TPOT", "ITL", "E2E"]
    rows = []
    for name, config in results["configs"].items():
        summary = config.get("by_rate", {}).get(key)
        if not summary:
            continue
        for group, values in summary["groups"].items():
            rows.append(
                [
                    name,
                    # Beside long prompts, "text" are the short ones (whose ITL a long prefill stalls).
                    "text (short)" if group == "text" and "long" in summary["groups"] else group,
                    str(values["num_requests"]),
                    *[" / ".join(_latency_cells(summary, group, m)) for m in ("ttft", "tpot", "itl", "e2e")],
                ]
            )
    return lines + markdown_table(header, rows)


def _ratios(results: dict[str, Any]) -> list[str]:
    analysis = results["analysis"]
    rate = analysis["target_rate"]
    ratios = analysis["ratios_to_disagg"]
    if rate is None or not ratios:
        return []
    key = f"{rate:g}"
    configs = [c for c in ratios if key in ratios[c]]
    title = f"## Ratios to (c) at {key} req/s (baseline / disaggregated; > 1 on a latency = (c) is faster"
    if "epd" in configs:
        title += "; epd / disagg < 1 on a latency = (d) E+P+D is faster than E+PD"
    lines = [title + ")", ""]
    rows = [[name] + [_num(ratios[c][key][name], 2) for c in configs] for name, *_ in RATIO_METRICS]
    return lines + markdown_table(["metric", *[f"{c} / disagg" for c in configs]], rows)


def _goodput(results: dict[str, Any]) -> list[str]:
    lines = ["## Goodput (highest swept rate with p99 TTFT and p99 TPOT within the SLO at it and every lower rate)", ""]
    rows = []
    for name, good in results["analysis"]["goodput"].items():
        passed = ", ".join(rate for rate, ok in good["passed"].items() if ok) or "none"
        rows.append([name, f"{good['rate']:g}" + (" (lower bound)" if good["lower_bound"] else ""), passed])
    return lines + markdown_table(["config", "goodput (req/s)", "rates meeting the SLO"], rows)


def _targets(results: dict[str, Any]) -> list[str]:
    targets = results["analysis"]["targets"]
    if not targets:
        return [
            "## Targets",
            "",
            ("This workload has no pass/fail target: the tables above report what disaggregation costs or gains."),
            "",
        ]
    rows = [
        [
            t["name"],
            _num(t["value"], 3),
            f"{t['comparison']} {t['limit']:g}",
            {True: "met", False: "**missed**", None: "not measured"}[t["met"]],
            t["note"],
        ]
        for t in targets
    ]
    return ["## Targets", ""] + markdown_table(["target", "measured", "needed", "result", "note"], rows)


def render_markdown(results: dict[str, Any]) -> str:
    """The whole ``results.md``."""
    lines = _setup(results) + _layout(results) + _per_rate(results) + _groups_at_target(results)
    lines += _ratios(results) + _goodput(results) + _targets(results)
    plots = results.get("plots", {})
    if plots:
        lines += ["## Plots", ""] + [f"![{name}]({path})" for name, path in plots.items()] + [""]
    return "\n".join(lines)

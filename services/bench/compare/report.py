"""Summaries, ratios and the one table of ``epd bench compare``.

Pure Python. A run's summary holds output tokens/s and, per request kind,
TTFT and inter-token latency (ITL) percentiles in milliseconds (the
definitions of ``services.bench.serve.stats``). Across runs the table shows
each server's range and the ratio of medians to the reference: a named peer,
or with ``best`` whichever peer did best on that figure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from services.bench.serve.stats import RequestRecord, percentile

KINDS = ("all", "text", "image")
LATENCIES = (("ttft", 50.0), ("ttft", 99.0), ("itl", 50.0), ("itl", 99.0))
STAGES = ("preprocess", "window", "preallocate", "encode", "queue", "embedding_wait", "prefill", "first_token")
"""The stages of a request's first token an ``epd`` proxy reports (``usage.epd.timings_ms``), in the order they
begin: proxy preprocessing, PD's reservation, the slowest Encode call (its push included), then PD's queue (arrival
to first step), time blocked on images, first step to first token; ``first_token`` is the proxy's arrival-to-first-
message. They overlap (Encode runs while PD queues), so they do not add up to the TTFT."""


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """One run of one workload on one server."""
    ok = [r for r in records if r.ok]
    starts = [r.start_s for r in records]
    ends = [r.start_s + r.e2e for r in ok]
    duration = (max(ends) - min(starts)) if ends else 0.0
    tokens = sum(r.num_tokens for r in ok)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "num_ok": len(ok),
        "errors": sorted({r.error for r in records if r.error}),
        "duration_s": round(duration, 3),
        "output_tokens": tokens,
        "tok_s": round(tokens / duration, 2) if duration > 0 else None,
    }
    for kind in KINDS:
        group = [r for r in ok if kind == "all" or r.kind == kind]
        if not group:
            continue
        values = {"ttft": [r.ttft for r in group], "itl": [gap for r in group for gap in r.itls]}
        out[kind] = {
            f"{metric}_p{q:g}_ms": round(1000 * percentile(values[metric], q), 1) if values[metric] else None
            for metric, q in LATENCIES
        }
        if stages := stage_medians(group):
            out[kind]["stages_ms"] = stages
    return out


def stage_medians(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Median of each reported stage (``STAGES``) over the requests that reported it; {} when none did."""
    found = {stage: [r.stages_ms[stage] for r in records if stage in r.stages_ms] for stage in STAGES}
    return {stage: round(statistics.median(values), 1) for stage, values in found.items() if values}


def token_counts(records: Sequence[RequestRecord]) -> dict[int, tuple[int, int]]:
    """Request index -> (prompt tokens, output tokens) of the requests that completed."""
    return {r.index: (r.prompt_tokens, r.num_tokens) for r in records if r.ok}


def check_tokens(counts: dict[str, list[dict[int, tuple[int, int]]]]) -> dict[str, Any]:
    """Do all servers and runs agree on every request's prompt and output token counts?

    ``counts[server]`` holds one ``token_counts`` per run. The first server's
    first run is the reference; a request missing from a run is not compared.
    Output counts must be equal. A server whose prompt counts all differ from
    the reference's by one constant (one BOS token more or fewer: whether the
    server adds the tokenizer's special tokens to a rendered chat template)
    agrees, with that offset reported; any other difference is a mismatch.
    """
    runs = [(name, run) for name, per_run in counts.items() for run in per_run]
    if not runs:
        return {"agree": True, "compared": 0, "prompt_offsets": {}, "mismatches": []}
    reference = runs[0][1]
    offsets: dict[str, set[int]] = {}
    pairs: list[tuple[str, int, tuple[int, int], tuple[int, int]]] = []
    for name, run in runs[1:]:
        for index, got in sorted(run.items()):
            want = reference.get(index)
            if want is not None:
                pairs.append((name, index, want, got))
                offsets.setdefault(name, set()).add(got[0] - want[0])
    constant = {name: next(iter(found)) for name, found in offsets.items() if len(found) == 1}
    mismatches = [
        {"server": name, "request": index, "expected": list(want), "got": list(got)}
        for name, index, want, got in pairs
        if got[1] != want[1] or (name not in constant and got != want)
    ]
    return {
        "agree": not mismatches,
        "compared": len(pairs),
        "prompt_offsets": {name: offset for name, offset in constant.items() if offset},
        "mismatches": mismatches[:20],
    }


def figures(workload_runs: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, bool]]:
    """(kind, key, higher_is_better) of every figure some server reported, tok/s first."""
    found = [("all", "tok_s", True)]
    present = [k for k in KINDS[1:] if any(k in run for runs in workload_runs.values() for run in runs)]
    # One kind only: its rows are the "all" rows, shown once.
    for kind in present if len(present) == 1 else ["all", *present]:
        found += [(kind, f"{metric}_p{q:g}_ms", False) for metric, q in LATENCIES]
    return found


def value(run: dict[str, Any], kind: str, key: str) -> float | None:
    if key == "tok_s":
        return run.get("tok_s")
    return (run.get(kind) or {}).get(key)


def median_of(runs: list[dict[str, Any]], kind: str, key: str) -> float | None:
    values = [v for v in (value(r, kind, key) for r in runs) if v is not None]
    return statistics.median(values) if values else None


def reference_value(
    workload_runs: dict[str, list[dict[str, Any]]],
    peers: Sequence[str],
    ratio_to: str,
    kind: str,
    key: str,
    higher: bool,
) -> tuple[str, float] | None:
    """(peer, median) the ratios of one figure are taken to: the named peer, or the best peer on it."""
    candidates = [p for p in peers if ratio_to in ("best", p)]
    medians = [(p, m) for p in candidates if (m := median_of(workload_runs.get(p, []), kind, key)) is not None]
    if not medians:
        return None
    pick = max if higher else min
    return pick(medians, key=lambda pm: pm[1])


def _range(runs: list[dict[str, Any]], kind: str, key: str) -> str:
    values = [v for v in (value(r, kind, key) for r in runs) if v is not None]
    if not values:
        return "–"
    low, high = min(values), max(values)
    fmt = "{:.1f}" if key == "tok_s" else "{:,.0f}"
    return fmt.format(low) if low == high else f"{fmt.format(low)}–{fmt.format(high)}"


FIGURE_NAMES = {
    "tok_s": "tok/s",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "itl_p50_ms": "ITL p50 ms",
    "itl_p99_ms": "ITL p99 ms",
}


def render(results: dict[str, Any]) -> str:
    """The markdown report: one table per workload, ranges over runs, ratios of medians to the reference."""
    servers: list[str] = results["servers"]
    peers = [s for s in servers if results["targets"][s]["peer"]]
    ours = [s for s in servers if not results["targets"][s]["peer"]]
    ratio_to = results["ratio_to"]
    lines = [f"# epd bench compare ({results['model']})", "", f"`{results['command']}`", ""]
    lines += [f"- **{s}**: {results['targets'][s]['label']}" for s in servers]
    lines += [
        f"- runs per server: {results['runs']}, interleaved; ratios are of medians over runs, to "
        + ("the best peer on each figure" if ratio_to == "best" else f"`{ratio_to}`")
        + " (tok/s: higher is better; latencies: lower is better)",
        "",
    ]
    for workload, per_server in results["workloads"].items():
        lines += [f"## {workload}: {results['workload_descriptions'][workload]}", ""]
        header = ["kind", "figure", *servers, *(f"{s} / ref" for s in ours if peers)]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for kind, key, higher in figures(per_server):
            row = [kind, FIGURE_NAMES[key], *(_range(per_server.get(s, []), kind, key) for s in servers)]
            reference = reference_value(per_server, peers, ratio_to, kind, key, higher) if peers else None
            for s in ours if peers else ():
                mine = median_of(per_server.get(s, []), kind, key)
                row.append(f"{mine / reference[1]:.2f}x" if mine is not None and reference and reference[1] else "–")
            lines.append("| " + " | ".join(row) + " |")
        check = results["token_check"].get(workload, {})
        verdict = (
            "agree" if check.get("agree") else f"DIFFER ({len(check.get('mismatches', []))} shown in results.json)"
        )
        failures = {s: sum(r["num_requests"] - r["num_ok"] for r in per_server.get(s, [])) for s in servers}
        lines += [
            "",
            f"Token counts of {check.get('compared', 0)} request pairs: {verdict}. "
            + "Failed requests: "
            + ", ".join(f"{s} {n}" for s, n in failures.items())
            + ".",
            "",
        ]
        lines += _stage_lines(per_server, servers)
    for server, errors in (results.get("start_failures") or {}).items():
        lines.append(f"- {server} did not start in {len(errors)} run(s): {errors[0]}")
    return "\n".join(lines) + "\n"


def _stage_lines(per_server: dict[str, list[dict[str, Any]]], servers: Sequence[str]) -> list[str]:
    """A table of the stage medians servers reported for one workload (median over runs), or nothing (a peer
    that is an ``epd`` cluster, such as the code before a change, reports them too)."""
    rows = []
    for server in servers:
        runs = per_server.get(server, [])
        kinds = [k for k in KINDS if any("stages_ms" in (run.get(k) or {}) for run in runs)]
        for kind in kinds if len(kinds) == 1 else [k for k in kinds if k != "all"]:
            stages = [(run.get(kind) or {}).get("stages_ms") or {} for run in runs]
            cells = []
            for stage in STAGES:
                values = [s[stage] for s in stages if stage in s]
                cells.append(f"{statistics.median(values):,.0f}" if values else "–")
            ttft = median_of(runs, kind, "ttft_p50_ms")
            rows.append([server, kind, "–" if ttft is None else f"{ttft:,.0f}", *cells])
    if not rows:
        return []
    header = ["server", "kind", "TTFT p50", *STAGES]
    return [
        "Where the first token's time went, as the server reports it (`usage.epd.timings_ms`; medians over "
        "requests, then over runs; ms; the stages overlap):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]

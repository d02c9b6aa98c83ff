"""Numbers per policy of ``epd bench multiturn``, pooled over runs, and ``results.md``.

Per policy and PD count, over every run: TTFT p50 / p99 of first turns and of
follow-ups; prompt tokens PD computed (prompt - cached, from each turn's
usage); Encode calls the proxy made, and follow-ups whose image PD did not
hold; requests each PD served and the busiest over the idlest PD; output
tokens per second (each run's output tokens over its duration, averaged);
failed turns. Then the ratios of a policy to the baseline's (least-loaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.bench.multiturn.runner import RunResult, Turn
from services.bench.serve.report import markdown_table
from services.bench.serve.stats import percentile, ratio, summarize_run

BASELINE = "least-loaded"


def _ms(values: list[float], q: float) -> float | None:
    return round(percentile(values, q) * 1000, 1) if values else None


def summarize(runs: Sequence[RunResult]) -> dict[str, Any]:
    """One policy at one PD count, pooled over ``runs``."""
    turns = [t for r in runs for t in r.turns]
    ok = [t for t in turns if t.record.ok]
    first = [t.record.ttft for t in ok if t.turn == 0]
    follow = [t.record.ttft for t in ok if t.turn > 0]
    balance = []
    for run in runs:
        counts = sorted(run.pd_requests.values())
        if counts and counts[0] > 0:
            balance.append(counts[-1] / counts[0])
        elif counts:
            balance.append(float("inf"))
    throughputs: list[float] = []
    for run in runs:
        throughput = summarize_run([t.record for t in run.turns]).get("output_token_throughput")
        if throughput:
            throughputs.append(float(throughput))
    return {
        "runs": len(runs),
        "turns": len(turns),
        "failed_turns": len(turns) - len(ok),
        "errors": [r.error for r in runs if r.error],
        "ttft_first_ms": {"p50": _ms(first, 50), "p99": _ms(first, 99), "n": len(first)},
        "ttft_follow_up_ms": {"p50": _ms(follow, 50), "p99": _ms(follow, 99), "n": len(follow)},
        "prompt_tokens": sum(t.record.prompt_tokens for t in ok),
        "computed_tokens": sum(t.computed_tokens for t in ok),
        "prompt_tokens_follow_up": sum(t.record.prompt_tokens for t in ok if t.turn > 0),
        "computed_tokens_follow_up": sum(t.computed_tokens for t in ok if t.turn > 0),
        "encode_calls": sum(r.encode_calls for r in runs),
        "follow_ups_re_encoded": sum(1 for t in ok if t.turn > 0 and t.images_ready == 0),
        "pd_requests": [sorted(r.pd_requests.values(), reverse=True) for r in runs],
        "max_over_min_requests": round(max(balance), 3) if balance else None,
        "output_tokens_per_s": round(sum(throughputs) / len(throughputs), 2) if throughputs else None,
    }


def summarize_all(results: Sequence[RunResult]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{num_pds: {policy: summary}}`` with each policy's ratios to the baseline's."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for num_pds in sorted({r.num_pds for r in results}):
        policies = sorted({r.policy for r in results if r.num_pds == num_pds}, key=lambda p: p != BASELINE)
        row = {p: summarize([r for r in results if r.num_pds == num_pds and r.policy == p]) for p in policies}
        base = row.get(BASELINE)
        for policy, summary in row.items():
            if base is not None and policy != BASELINE:
                summary["vs_baseline"] = {
                    "ttft_follow_up_p50": ratio(summary["ttft_follow_up_ms"]["p50"], base["ttft_follow_up_ms"]["p50"]),
                    "ttft_first_p50": ratio(summary["ttft_first_ms"]["p50"], base["ttft_first_ms"]["p50"]),
                    "computed_tokens": ratio(summary["computed_tokens"], base["computed_tokens"]),
                    "computed_tokens_follow_up": ratio(
                        summary["computed_tokens_follow_up"], base["computed_tokens_follow_up"]
                    ),
                    "output_tokens_per_s": ratio(summary["output_tokens_per_s"], base["output_tokens_per_s"]),
                }
        table[str(num_pds)] = row
    return table


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}" if value == int(value) else f"{value:.2f}"
    return str(value)


def render_markdown(results: dict[str, Any]) -> str:
    """The results as the table the docs show, with the setup above it."""
    plan, settings = results["plan"], results["settings"]
    lines = [
        "# epd bench multiturn",
        "",
        f"Command: `{results['command']}`",
        "",
        f"- Machine: {results['machine']}; load average before {results['load_average']['before']}, "
        f"after {results['load_average']['after']}",
        f"- Model: `{results['model']}`",
        f"- Chats: {plan['num_users']} users, {plan['num_turns']} turns each (the first with a "
        f"{plan['image_size']} px image), a {plan['system_words']}-word system prompt shared by all, "
        f"{plan['question_words']}-word questions, {plan['max_tokens']}-token answers (greedy, ignore_eos); users "
        f"start {settings['stagger_s']} s apart and send their next turn {settings['think_s']} s after an answer "
        f"(means; {settings.get('pacing', 'fixed')} draws, seeded)",
        f"- Order: {results['order']}",
        "",
    ]
    header = [
        "PDs",
        "policy",
        "runs",
        "TTFT first p50 / p99 (ms)",
        "TTFT follow-up p50 / p99 (ms)",
        "prompt tokens computed: all / follow-ups",
        "Encode calls (follow-ups re-encoded)",
        "requests per PD (max / min)",
        "output tok/s",
        "failed",
    ]
    rows = []
    for num_pds, policies in results["summary"].items():
        for policy, s in policies.items():
            per_pd = "; ".join("/".join(_cell(c) for c in counts) for counts in s["pd_requests"])
            rows.append(
                [
                    num_pds,
                    policy,
                    str(s["runs"]),
                    f"{_cell(s['ttft_first_ms']['p50'])} / {_cell(s['ttft_first_ms']['p99'])}",
                    f"{_cell(s['ttft_follow_up_ms']['p50'])} / {_cell(s['ttft_follow_up_ms']['p99'])}",
                    f"{s['computed_tokens']} of {s['prompt_tokens']} / "
                    f"{s['computed_tokens_follow_up']} of {s['prompt_tokens_follow_up']}",
                    f"{_cell(s['encode_calls'])} ({s['follow_ups_re_encoded']})",
                    f"{per_pd} ({_cell(s['max_over_min_requests'])})",
                    _cell(s["output_tokens_per_s"]),
                    str(s["failed_turns"]),
                ]
            )
    lines += markdown_table(header, rows)
    ratio_rows = []
    for num_pds, policies in results["summary"].items():
        for policy, s in policies.items():
            if "vs_baseline" in s:
                v = s["vs_baseline"]
                ratio_rows.append(
                    [
                        num_pds,
                        policy,
                        _cell(v["ttft_follow_up_p50"]),
                        _cell(v["computed_tokens"]),
                        _cell(v["computed_tokens_follow_up"]),
                        _cell(v["ttft_first_p50"]),
                        _cell(v["output_tokens_per_s"]),
                    ]
                )
    if ratio_rows:
        lines += [f"Ratios to {BASELINE}:", ""]
        lines += markdown_table(
            [
                "PDs",
                "policy",
                "follow-up TTFT p50",
                "prompt tokens computed",
                "of follow-ups",
                "first-turn TTFT p50",
                "output tok/s",
            ],
            ratio_rows,
        )
    return "\n".join(lines)


def turns_json(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Every turn of every run (requests.jsonl)."""
    return [{"policy": r.policy, "num_pds": r.num_pds, "run": r.run, **t.to_json()} for r in results for t in r.turns]


__all__ = ["Turn", "render_markdown", "summarize_all", "turns_json"]

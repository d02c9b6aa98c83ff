"""Side by side with any OpenAI-compatible server: ``epd up`` in its modes against peers (vLLM, SGLang, ...).

Every server runs the same seeded workloads on the same checkpoint with the
same streaming client, one server alone on the machine at a time, runs
interleaved (run 2 visits the servers in another order than run 1):

- ``burst``: 32 concurrent text requests, ~100-token prompts, 64 tokens out;
- ``image-burst``: 16 concurrent requests, one 224x224 PNG each, 32 out;
- ``mixed``: open loop for 60 s, text at 1 req/s beside one-image requests
  at 0.25 req/s, 64 out.

Each request is greedy with a fixed output length (``ignore_eos``). The
report (``--out``: results.md, results.json, requests.jsonl) gives output
tok/s, TTFT p50/p99 and ITL p50/p99 per workload and request kind, each
server's range over the runs, and the ratio of each ``epd up`` mode's median
to the peer's (``--ratio-to``: a peer's name, or ``best``, the best peer on
each figure). It also checks that every server returned the same prompt and
output token counts for every request.

A peer is ``--peer NAME=URL``; with ``--peer-start NAME=COMMAND`` the
benchmark starts it for each of its runs and stops it after (``{model}``
and ``{port}`` in COMMAND are replaced), which is what keeps it alone on the
machine. Running vLLM's CPU build beside the cluster: see the benchmarks
page of the documentation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from services.common import cli_args

DEFAULT_WORKLOADS = ("burst", "image-burst", "mixed")


def _pairs(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from services.bench.compare.servers import EPD_MODES
    from services.bench.compare.workloads import WORKLOADS

    add = cli_args.add_flag
    servers = parser.add_argument_group("servers")
    add(
        servers,
        "--model",
        default="bench",
        help="checkpoint directory or preset (built on first use); a peer "
        "started with --peer-start gets the same directory as {model}",
    )
    add(
        servers,
        "--configs",
        type=_names,
        default=("up", "colocated"),
        help=f"epd up modes to measure, comma-separated: {', '.join(EPD_MODES)} (up: encoder + PD; colocated: one "
        "PD that also encodes; epd: E+P+D); '' = none",
    )
    servers.add_argument(
        "--peer",
        type=_pairs,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an OpenAI-compatible server to compare with (repeatable)",
    )
    servers.add_argument(
        "--peer-start",
        type=_pairs,
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="shell command that starts peer NAME on its URL's port; started before each of its "
        "runs and stopped after ({model}, {port} are replaced)",
    )
    add(servers, "--ready-timeout", type=float, default=900.0, help="seconds a server may take to answer")
    work = parser.add_argument_group("workloads and report")
    add(
        work,
        "--workloads",
        type=_names,
        default=DEFAULT_WORKLOADS,
        help=f"comma-separated, run in this order: {', '.join(WORKLOADS)}",
    )
    add(work, "--runs", type=int, default=2, help="runs per server, interleaved")
    add(work, "--seed", type=int, default=0, help="prompts, images and arrivals are drawn from it")
    add(work, "--scale", type=float, default=1.0, help="shrink request counts and the open-loop schedule (smoke runs)")
    add(
        work, "--ratio-to", default="best", help="peer the ratios are to: a --peer name, or best (best peer per figure)"
    )
    add(work, "--request-timeout", type=float, default=600.0, help="seconds one request may take")
    add(work, "--out", type=Path, default=Path("results/compare"), help="results.md, results.json, requests.jsonl")


def _targets(args: argparse.Namespace) -> list:
    from services.bench.compare.servers import EPD_MODES, Target

    unknown = [c for c in args.configs if c not in EPD_MODES]
    if unknown:
        raise SystemExit(
            f"epd bench compare: unknown --configs {', '.join(unknown)} (choose from {', '.join(EPD_MODES)})"
        )
    starts = dict(args.peer_start)
    peers = dict(args.peer)
    if missing := sorted(set(starts) - set(peers)):
        raise SystemExit(f"epd bench compare: --peer-start for {', '.join(missing)} without --peer NAME=URL")
    if args.ratio_to != "best" and args.ratio_to not in peers:
        raise SystemExit(f"epd bench compare: --ratio-to {args.ratio_to!r} is not a --peer name")
    targets = [Target(name, up_args=EPD_MODES[name]) for name in args.configs]
    targets += [Target(name, url=url, start=starts.get(name, "")) for name, url in peers.items()]
    if not targets:
        raise SystemExit("epd bench compare: nothing to measure (no --configs and no --peer)")
    if len({t.name for t in targets}) != len(targets):
        raise SystemExit("epd bench compare: a peer is named like an epd up mode")
    return targets


def run(args: argparse.Namespace) -> int:
    from services.bench.compare import report, servers, workloads
    from services.bench.serve.command import _model_dir

    if args.runs < 1 or not 0 < args.scale <= 1:
        raise SystemExit("epd bench compare: --runs must be >= 1 and --scale in (0, 1]")
    if unknown := [w for w in args.workloads if w not in workloads.WORKLOADS]:
        raise SystemExit(f"epd bench compare: unknown --workloads {', '.join(unknown)}")
    targets = _targets(args)
    model_dir = _model_dir(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    plans = {name: workloads.build(workloads.WORKLOADS[name], args.seed, scale=args.scale) for name in args.workloads}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {t.name: [] for t in targets} for w in args.workloads}
    counts: dict[str, dict[str, list]] = {w: {t.name: [] for t in targets} for w in args.workloads}
    failures: dict[str, list[str]] = {}
    with open(args.out / "requests.jsonl", "w") as log:
        for run_index in range(args.runs):
            shift = run_index % len(targets)
            for target in targets[shift:] + targets[:shift]:
                servers.say(f"run {run_index + 1}/{args.runs}: starting {target.label}")
                try:
                    _measure(args, target, model_dir, plans, run_index, runs, counts, log)
                except RuntimeError as error:  # a server that does not start: its run is lost, not the others'
                    servers.say(f"run {run_index + 1}: {target.name}: {error}")
                    failures.setdefault(target.name, []).append(str(error))
    results = {
        "schema": "epd-bench-compare/1",
        "command": shlex.join(["epd", *sys.argv[1:]]) if sys.argv[1:3] == ["bench", "compare"] else "epd bench compare",
        "model": model_dir,
        "machine": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
        "runs": args.runs,
        "ratio_to": args.ratio_to,
        "servers": [t.name for t in targets],
        "targets": {t.name: {"label": t.label, "peer": t.is_peer} for t in targets},
        "workload_descriptions": {w: workloads.WORKLOADS[w].description for w in args.workloads},
        "workloads": runs,
        "token_check": {w: report.check_tokens(c) for w, c in counts.items()},
        "start_failures": failures,
        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = report.render(results)
    (args.out / "results.md").write_text(markdown)
    print(markdown)
    return 0 if all(check["agree"] for check in results["token_check"].values()) else 1


def _measure(args, target, model_dir: str, plans: dict, run_index: int, runs: dict, counts: dict, log) -> None:
    """One server's run: start it, warm it up, run every workload, stop it."""
    from services.bench.compare import report, servers, workloads

    with servers.serving(target, model_dir, ready_timeout_s=args.ready_timeout, log_dir=args.out) as url:
        model = servers.model_id(url)
        for record in _warm_up(url, model, args):
            entry = {"server": target.name, "run": run_index, "workload": "first-after-ready", **record.to_json()}
            log.write(json.dumps(entry) + "\n")
        for name, requests in plans.items():
            servers.say(f"run {run_index + 1}: {target.name}: {name} ({len(requests)} requests)")
            records = asyncio.run(_schedule(url, requests, workloads.encode(requests, model), args.request_timeout))
            summary = report.summarize(records)
            runs[name][target.name].append(summary)
            counts[name][target.name].append(report.token_counts(records))
            servers.say(f"  {summary['num_ok']}/{summary['num_requests']} ok, {summary['tok_s']} tok/s")
            for record in records:
                entry = {"server": target.name, "run": run_index, "workload": name, **record.to_json()}
                log.write(json.dumps(entry) + "\n")


def _warm_up(url: str, model: str, args: argparse.Namespace) -> list:
    """One text and one image request, repeated until both succeed: first-call costs stay out of the
    measurement, and a server that serves text before images (an encoder still starting) is waited for.
    Returns the first attempt's records (the first requests after ready)."""
    from services.bench.compare import workloads

    warm = workloads.warmup(args.seed)
    deadline = time.monotonic() + args.ready_timeout
    first = None
    while True:
        records = asyncio.run(_schedule(url, warm, workloads.encode(warm, model), args.request_timeout))
        first = first or records
        if all(r.ok for r in records):
            return first
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up requests failed for {args.ready_timeout:.0f} s: {records[-1].error}")
        time.sleep(2.0)


async def _schedule(url: str, requests: list, bodies: list[bytes], timeout_s: float) -> list:
    """Sends ``requests`` at their arrival times to ``url``; their records, in request order."""
    import httpx

    from services.bench.serve.client import Targets, send_one
    from services.bench.serve.stats import RequestRecord

    targets = Targets([url])
    records = [
        RequestRecord(
            index=r.index, kind=r.kind, num_images=int(r.kind == "image"), image_class=None, scheduled_s=r.arrival_s
        )
        for r in requests
    ]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(1, len(requests)))
    async with httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0), trust_env=False
    ) as client:
        start = time.perf_counter()
        tasks = []
        for request, body, record in zip(requests, bodies, records):
            delay = start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_one(client, targets, body, record, start)))
        await asyncio.gather(*tasks)
    return records

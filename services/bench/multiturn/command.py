"""Multi-turn image chats over several PDs: PD routing policies (--pd-policy) side by side.

Each user has a chat: a system prompt all users share, an image in the first
user turn, then follow-ups that resend the whole history (the answers
included), as chat clients do. Users run at once: starts and think times are
drawn per user from the seed (exponential around --stagger-s and --think-s by
default), so turns of different users interleave as real chats' do and every
policy meets the same schedule. For every PD count (``--pds``) and run
(``--runs``) a fresh cluster is started per policy (one encoder, the PDs, one
proxy), policies interleaved run by run, every policy meeting the same chats.

Reported per policy: TTFT p50/p99 of first turns and of follow-ups, prompt
tokens PD computed (prompt - cached, from each turn's usage), Encode calls
(and follow-ups whose image PD no longer held), requests per PD and the
busiest over the idlest, output tokens per second, and each policy's ratios
to least-loaded's. Outputs in ``--out``: results.json, results.md,
requests.jsonl (every turn).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from services.bench.multiturn.conversations import PACINGS
from services.common import cli_args

POLICIES = ("least-loaded", "cache-aware", "round-robin")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected policies from {', '.join(POLICIES)}, got {text!r}")
    return names


def _ints(text: str, least: int = 0) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < least for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= {least}")
    return values


def _counts(text: str) -> tuple[int, ...]:
    values = _ints(text, least=1)
    if not values:
        raise argparse.ArgumentTypeError("expected at least one count")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = cli_args.add_flag
    chats = parser.add_argument_group("chats")
    add(chats, "--model", default="bench", help="checkpoint directory or preset (built on first use)")
    add(chats, "--users", type=int, default=8, help="chats running at once")
    add(chats, "--turns", type=int, default=4, help="turns of each chat (the first, then follow-ups)")
    add(chats, "--system-words", type=int, default=300, help="words of the system prompt every chat shares")
    add(chats, "--question-words", type=int, default=24, help="words of each user message")
    add(chats, "--max-tokens", type=int, default=32, help="tokens of each answer (ignore_eos)")
    add(chats, "--stagger-s", type=float, default=1.0, help="mean seconds between two users' first turns")
    add(chats, "--think-s", type=float, default=2.0, help="mean seconds between an answer and the user's next turn")
    add(
        chats,
        "--pacing",
        default="exponential",
        choices=list(PACINGS),
        help="how start gaps and think times vary around their means (seeded; fixed = every user in lock step)",
    )
    add(chats, "--seed", type=int, default=0, help="seed of the texts, images, start gaps and think times")
    runs = parser.add_argument_group("runs")
    add(runs, "--policies", type=_names, default=("least-loaded", "cache-aware"), help="PD policies to compare")
    add(runs, "--pds", type=_counts, default=(2, 4), help="PD counts to run, comma-separated")
    add(runs, "--runs", type=int, default=2, help="runs per policy and PD count (policies interleaved)")
    add(runs, "--cores", type=_ints, default=(), help="CPU ids to pin to ('' = this process's affinity)")
    svc = parser.add_argument_group("services")
    add(svc, "--pd-args", default="", help="extra flags for every PD (shell syntax)")
    add(svc, "--proxy-args", default="", help="extra flags for the proxy (shell syntax), e.g. '--pd-cache-weight 4'")
    add(
        svc, "--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="services' log level"
    )
    add(svc, "--startup-timeout", type=float, default=600.0, help="seconds for a cluster to become ready")
    out = parser.add_argument_group("output")
    add(out, "--out", default="", help="output directory ('' = results/multiturn)")


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs"


def run(args: argparse.Namespace) -> int:
    from services.bench.multiturn.conversations import ChatPlan
    from services.bench.multiturn.report import render_markdown, summarize_all, turns_json
    from services.bench.multiturn.runner import RunSettings, run_one
    from services.bench.serve.command import _image_size, _model_dir
    from services.bench.serve.procs import ServiceArgs

    if (
        args.users < 1
        or args.turns < 2
        or args.runs < 1
        or args.max_tokens < 2
        or min(args.stagger_s, args.think_s) < 0
    ):
        print(
            "epd bench multiturn: --users, --runs >= 1, --turns and --max-tokens >= 2, --stagger-s and --think-s >= 0",
            file=sys.stderr,
        )
        return 2
    cores = tuple(args.cores) or tuple(sorted(os.sched_getaffinity(0)))
    model_dir = _model_dir(args.model)
    plan = ChatPlan(
        num_users=args.users,
        num_turns=args.turns,
        system_words=args.system_words,
        question_words=args.question_words,
        max_tokens=args.max_tokens,
        image_size=_image_size(model_dir),
        seed=args.seed,
    )
    settings = RunSettings(
        stagger_s=args.stagger_s, think_s=args.think_s, pacing=args.pacing, startup_timeout_s=args.startup_timeout
    )
    service = ServiceArgs(
        model_dir=model_dir,
        log_level=args.log_level,
        pd_args=tuple(shlex.split(args.pd_args)),
        proxy_args=tuple(shlex.split(args.proxy_args)),
    )
    out_dir = Path(args.out or "results/multiturn")
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    results = []
    for num_pds in args.pds:
        for run_index in range(args.runs):
            # Interleaved, and the first policy alternates: a drift in the machine's load hits each alike.
            order = args.policies if run_index % 2 == 0 else tuple(reversed(args.policies))
            for policy in order:
                results.append(
                    run_one(
                        policy,
                        num_pds,
                        run_index,
                        plan=plan,
                        service=service,
                        cores=cores,
                        settings=settings,
                        log_dir=out_dir / "logs" / f"pds{num_pds}",
                    )
                )
    report = {
        "command": shlex.join(["epd", *sys.argv[1:]])
        if sys.argv[1:3] == ["bench", "multiturn"]
        else "epd bench multiturn",
        "machine": f"{_machine()}, cores {list(cores)}",
        "model": model_dir,
        "plan": asdict(plan),
        "settings": asdict(settings),
        "order": "per PD count, run by run; policies interleaved, the first alternating",
        "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        "summary": summarize_all(results),
    }
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    with open(out_dir / "requests.jsonl", "w") as file:
        for row in turns_json(results):
            file.write(json.dumps(row) + "\n")
    markdown = render_markdown(report)
    (out_dir / "results.md").write_text(markdown + "\n")
    print(markdown, flush=True)
    return 1 if any(r.error for r in results) else 0

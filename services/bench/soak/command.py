"""Reliability soak: a bounded Locust run with process faults, then a quiet-time leak and memory check.

``epd bench soak`` starts a cluster as processes (by default 2 encoders,
2 PDs and a proxy on the tiny model), then:

1. fault phase (``--fault-phase-s``): Locust load of every kind (text, new
   images, repeated images, clients hanging up mid-stream, invalid inputs)
   while, one after another, an encoder and a PD are SIGKILLed and a PD is
   SIGTERMed (drain), each restarted on its address; recovery and rejoin
   times are measured (see ``faults.py``);
2. soak phase (``--duration-s``): the same load without faults; resident
   memory of every process is sampled when it starts and when it ends;
3. quiescence: every PD and encoder is asked (GetLoad) what it still holds.

Results go to ``--out`` as results.json and results.md (the README table).
The command exits 1 when a request failed in the soak phase, a process
leaked, or memory drifted by more than ``--max-rss-drift``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.bench.serve.layout import ProcessSpec, Topology
from services.bench.serve.procs import Cluster, ServiceArgs
from services.bench.soak.report import locust_outcomes, markdown, quiescent_load, rss_bytes

LOCUSTFILE = Path(__file__).resolve().parents[3] / "load" / "locustfile.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="tiny", help="checkpoint directory or preset (default: tiny)")
    add("--encoders", type=int, default=2, help="encoder processes (default: 2)")
    add("--pds", type=int, default=2, help="PD processes (default: 2; faults need 2)")
    add("--duration-s", type=float, default=600.0, help="soak phase: load without faults, seconds (default: 600)")
    add(
        "--fault-phase-s",
        type=float,
        default=120.0,
        help="fault phase before it, seconds (0 = no faults; default: 120)",
    )
    add("--users", type=int, default=8, help="Locust users, >= 6 so every kind runs (default: 8)")
    add("--spawn-rate", type=float, default=4.0, help="Locust users started per second (default: 4)")
    add("--max-tokens", type=int, default=16, help="tokens of every chat request (default: 16)")
    add("--image-size", type=int, default=64, help="side of the random images, pixels (default: 64)")
    add("--think-time", type=float, default=0.2, help="seconds between a user's requests (default: 0.2)")
    add(
        "--rss-warmup-s",
        type=float,
        default=60.0,
        help="seconds of soak-phase load before the first memory "
        "sample: allocator pools, attention buffers and caches fill up first (default: 60)",
    )
    add("--max-rss-drift", type=float, default=0.05, help="largest allowed relative RSS growth (default: 0.05)")
    add("--ready-timeout-s", type=float, default=180.0, help="start-up and recovery limit, seconds (default: 180)")
    add("--grace-s", type=float, default=10.0, help="SIGTERM drain grace of every process (default: 10)")
    add("--out", default="results/soak", help="output directory (default: results/soak)")


def _topology(encoders: int, pds: int) -> Topology:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    enc = [ProcessSpec(f"encoder-{i}", "encoder", cores, 1) for i in range(encoders)]
    pd = [ProcessSpec(f"pd-{i}", "pd", cores, 1) for i in range(pds)]
    proxy = ProcessSpec(
        "proxy", "proxy", cores, 1, pd_names=tuple(p.name for p in pd), encoder_names=tuple(e.name for e in enc)
    )
    return Topology("soak", f"{encoders}E+{pds}PD", (*enc, *pd, proxy))


def _locust(base_url: str, seconds: float, args: argparse.Namespace, csv_prefix: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        str(args.users),
        "-r",
        str(args.spawn_rate),
        "-t",
        f"{max(1, round(seconds))}s",
        "--host",
        base_url,
        "--only-summary",
        "--max-tokens",
        str(args.max_tokens),
        "--image-size",
        str(args.image_size),
        "--think-time",
        str(args.think_time),
        "--csv",
        str(csv_prefix),
        "--stop-timeout",
        "30",
        "--text-weight",
        "2",
        "--image-weight",
        "1",
        "--repeat-weight",
        "1",
        "--disconnect-weight",
        "1",
        "--invalid-weight",
        "1",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_LOAD_", "LOCUST_"))}
    log = open(csv_prefix.with_suffix(".log"), "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def _faults(cluster: Cluster, args: argparse.Namespace, base_url: str, stop_at: float) -> list[dict[str, Any]]:
    """SIGKILL the last encoder, SIGKILL the last PD, SIGTERM the first PD: each restarted, spaced over the phase."""
    from services.bench.soak.faults import inject

    plan = [
        (f"encoder-{args.encoders - 1}", signal.SIGKILL),
        (f"pd-{args.pds - 1}", signal.SIGKILL),
        ("pd-0", signal.SIGTERM),
    ]
    results = []
    for index, (name, sig) in enumerate(plan):
        when = stop_at - args.fault_phase_s * (1 - (index + 0.5) / len(plan))
        time.sleep(max(0.0, when - time.monotonic()))
        print(f"  fault: {sig.name} {name}", file=sys.stderr)
        result = inject(
            cluster,
            cluster.child(name),
            sig,
            base_url=base_url,
            image_size=args.image_size,
            ready_timeout_s=args.ready_timeout_s,
            grace_s=args.grace_s,
        )
        print(
            f"    recovered in {result.recovered_s}s, rejoined {result.rejoined_s}s after restart, "
            f"exit code {result.exit_code}",
            file=sys.stderr,
        )
        results.append(result.as_dict())
    return results


def _phase(
    cluster: Cluster, args: argparse.Namespace, name: str, seconds: float, out: Path, with_faults: bool
) -> dict[str, Any]:
    base_url = cluster.proxy_urls[0]
    print(
        f"{name} phase: {seconds:.0f}s of Locust load, {args.users} users"
        f"{', with process faults' if with_faults else ''}",
        file=sys.stderr,
    )
    pids = {c.spec.name: c.pid for c in cluster.children}
    locust = _locust(base_url, seconds, args, out / name)
    faults: list[dict[str, Any]] = []
    if with_faults:
        faults = _faults(cluster, args, base_url, time.monotonic() + seconds)
    else:  # memory is compared from a warm start: first requests grow pools that are then reused
        time.sleep(min(args.rss_warmup_s, seconds / 2))
    rss_start = {n: rss_bytes(pid) for n, pid in pids.items()}
    locust.wait(timeout=seconds + 120)
    pids_end = {c.spec.name: c.pid for c in cluster.children}
    rss_end = {n: rss_bytes(pid) for n, pid in pids_end.items()}
    restarted = sorted(n for n in pids if pids[n] != pids_end[n])
    return {
        "name": name,
        "seconds": seconds,
        "locust_exit_code": locust.returncode,
        "outcomes": locust_outcomes(out / f"{name}_stats.csv"),
        "faults": faults,
        "rss_start": rss_start,
        "rss_end": rss_end,
        "restarted": restarted,
    }


def run(args: argparse.Namespace) -> int:
    from services.bench.serve.command import _model_dir

    if args.users < 6:
        print("epd bench soak: --users must be >= 6 (one user of each kind at least)", file=sys.stderr)
        return 2
    if args.pds < 2 and args.fault_phase_s > 0:
        print("epd bench soak: process faults need --pds >= 2 (or --fault-phase-s 0)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(args.model)
    grace = ["--grace", str(args.grace_s)]
    service = ServiceArgs(model_dir=model_dir, pd_args=tuple(grace), proxy_args=tuple(grace), encoder_args=tuple(grace))
    cluster = Cluster(_topology(args.encoders, args.pds), service, out / "logs")
    started = time.monotonic()
    cluster.start()
    try:
        asyncio.run(cluster.wait_ready(args.ready_timeout_s))
        print(
            f"cluster ready in {time.monotonic() - started:.1f}s: "
            + ", ".join(f"{c.spec.name} {c.address}" for c in cluster.children),
            file=sys.stderr,
        )
        phases = []
        if args.fault_phase_s > 0:
            phases.append(_phase(cluster, args, "faults", args.fault_phase_s, out, with_faults=True))
        phases.append(_phase(cluster, args, "soak", args.duration_s, out, with_faults=False))
        quiet = asyncio.run(quiescent_load(cluster, timeout_s=30.0))
    finally:
        exit_codes = cluster.stop(grace_s=args.grace_s + 5)
    results = {
        "model": model_dir,
        "topology": cluster.topology.label,
        "args": vars(args),
        "phases": phases,
        "quiescent": quiet,
        "exit_codes": exit_codes,
        "max_rss_drift": args.max_rss_drift,
    }
    report, ok = markdown(results)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(report)
    print(report)
    return 0 if ok else 1

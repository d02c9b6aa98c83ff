"""Measurements and the report of ``epd bench soak``: Locust outcomes, resident memory, quiescent load."""

from __future__ import annotations

import asyncio
import csv
import time
from pathlib import Path
from typing import Any

OUTCOMES = ("succeeded", "rejected", "disconnected", "bad-input-rejected", "failed")


def locust_outcomes(stats_csv: Path) -> dict[str, int]:
    """Requests by outcome from Locust's ``*_stats.csv`` (the locustfile's ``OUTCOME`` rows), plus ``sent``."""
    counts = dict.fromkeys(OUTCOMES, 0)
    try:
        with open(stats_csv, newline="") as file:
            for row in csv.DictReader(file):
                if row["Type"] == "OUTCOME" and row["Name"] in counts:
                    counts[row["Name"]] += int(row["Request Count"])
    except FileNotFoundError:
        pass
    counts["sent"] = sum(counts.values())
    return counts


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of ``pid`` from /proc (None when it is gone, or was never started: None)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _load_of(child: Any) -> dict[str, int]:
    from services.common import grpc_utils
    from services.common.pb import epd_pb2, epd_pb2_grpc

    channel = grpc_utils.aio_channel(child.address)
    try:
        if child.spec.role == "pd":
            pd_load = await epd_pb2_grpc.PrefillDecodeStub(channel).GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
            return {
                "running": pd_load.num_running,
                "waiting": pd_load.num_waiting,
                "kv_blocks_used": pd_load.num_kv_blocks_used,
                "reserved_tokens": pd_load.embedding_tokens_reserved,
                "reservations": pd_load.num_reservations,
            }
        encoder_load = await epd_pb2_grpc.EncoderStub(channel).GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
        return {"pending": encoder_load.num_pending, "outbound_bytes": encoder_load.outbound_bytes}
    finally:
        await channel.close()


async def quiescent_load(cluster: Any, timeout_s: float) -> dict[str, dict[str, int]]:
    """What every PD and encoder still holds once traffic stopped (polled until all zero or ``timeout_s``)."""
    servers = [c for c in cluster.children if c.spec.role in ("pd", "encoder")]
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {c.spec.name: await _load_of(c) for c in servers}
        if all(not any(v.values()) for v in loads.values()) or time.monotonic() > deadline:
            return loads
        await asyncio.sleep(0.5)


def _drift(start: int | None, end: int | None) -> float | None:
    return None if not start or end is None else (end - start) / start


def markdown(results: dict[str, Any]) -> tuple[str, bool]:
    """The README table of one soak run, and whether it passed."""
    phases = {p["name"]: p for p in results["phases"]}
    soak = phases["soak"]
    lines = [
        f"Cluster {results['topology']} on `{Path(results['model']).name}`.",
        "",
        "| measure | " + " | ".join(f"{name} phase" for name in phases) + " |",
        "|---|" + "---|" * len(phases),
    ]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("duration (s)", [f"{p['seconds']:.0f}" for p in phases.values()])
    for key, label in (
        ("sent", "requests sent"),
        ("succeeded", "succeeded"),
        ("disconnected", "client hung up mid-stream (cancelled cleanly)"),
        ("rejected", "cleanly rejected (503 + Retry-After)"),
        ("bad-input-rejected", "bad inputs tried, each a clean 4xx"),
        ("failed", "failed"),
    ):
        row(label, [str(p["outcomes"][key]) for p in phases.values()])
    lines.append("")
    faults = [f for p in phases.values() for f in p["faults"]]
    if faults:
        lines += [
            "| fault injected | exit code | served again after (s) | rejoined after restart (s) |",
            "|---|---|---|---|",
        ]
        lines += [f"| {f['fault']} | {f['exit_code']} | {f['recovered_s']} | {f['rejoined_s']} |" for f in faults]
        lines.append("")
    lines += ["| after quiescence | value |", "|---|---|"]
    quiet = results["quiescent"]
    for key in ("reserved_tokens", "reservations", "kv_blocks_used", "running", "waiting", "pending", "outbound_bytes"):
        values = [v[key] for v in quiet.values() if key in v]
        lines.append(f"| {key.replace('_', ' ')} (sum over processes) | {sum(values)} |")
    lines += ["", "| process | RSS after soak warm-up (MiB) | at end (MiB) | drift |", "|---|---|---|---|"]
    drifts = []
    for name, start in soak["rss_start"].items():
        end = soak["rss_end"].get(name)
        drift = _drift(start, end)
        drifts.append(drift)
        shown = "n/a" if drift is None else f"{drift * 100:+.1f}%"
        lines.append(f"| {name} | {(start or 0) / 2**20:.0f} | {(end or 0) / 2**20:.0f} | {shown} |")
    leaked = any(any(v.values()) for v in quiet.values())
    ok = (
        soak["outcomes"]["failed"] == 0
        and not leaked
        and not soak["restarted"]
        and all(d is not None and d <= results["max_rss_drift"] for d in drifts)
    )
    lines += [
        "",
        f"Result: {'PASS' if ok else 'FAIL'} (soak phase without failures, nothing held after "
        f"quiescence, RSS drift <= {results['max_rss_drift'] * 100:.0f}%).",
    ]
    return "\n".join(lines) + "\n", ok

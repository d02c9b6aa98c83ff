"""``epd up``: the whole cluster as local processes.

Starts N encoders and M PDs, then the proxy in front of them, waits until
every one reports ready, prints the URL, and on Ctrl-C / SIGTERM stops them
in order (proxy first, so no new work arrives; then encoders; then PDs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from services.common import cli_args, grpc_utils, security


@dataclass
class Child:
    """One service process started by the launcher."""

    name: str
    process: subprocess.Popen
    address: str
    health_service: str | None  # gRPC service name; None = HTTP /health


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = cli_args.add_flag
    add(parser, "--model", default="", help="checkpoint directory, preset name (tiny, bench, qwen2.5-vl-tiny, ...; see epd make-model) or hub id of a LLaVA, Qwen2-VL or Qwen2.5-VL checkpoint; default: the tiny model, built on first use")
    add(parser, "--encoders", type=int, default=1, help="number of encoder processes")
    add(parser, "--pds", type=int, default=1, help="number of PD processes")
    add(parser, "--pd-policy", default="least-loaded", choices=["least-loaded", "round-robin"],
        help="proxy: how a PD is chosen (other proxy flags: set their EPD_* variables)")
    add(parser, "--encoder-policy", default="rendezvous", choices=["rendezvous", "least-loaded", "round-robin"],
        help="proxy: how an encoder is chosen for an image")
    add(parser, "--colocated", default=False, help="baseline mode: no encoder processes; the PD loads the vision tower and encodes inside its step loop like a monolithic engine (needs --pds 1)")
    add(parser, "--host", default="127.0.0.1", help="address every service listens on")
    add(parser, "--port", type=int, default=8000, help="proxy HTTP port")
    add(parser, "--encoder-base-port", type=int, default=50051, help="encoder i listens on this port + i")
    add(parser, "--pd-base-port", type=int, default=50061, help="PD j listens on this port + j")
    add(parser, "--encoder-metrics-base-port", type=int, default=9101,
        help="encoder i serves Prometheus /metrics on this port + i (-1 = off)")
    add(parser, "--pd-metrics-base-port", type=int, default=9201,
        help="PD j serves Prometheus /metrics on this port + j (-1 = off)")
    add(parser, "--device", default="auto", help="torch device for encoders and PDs")
    add(parser, "--dtype", default="auto", help="dtype for encoders and PDs")
    add(parser, "--threads", type=int, default=0, help="torch threads per process (0 = torch default)")
    add(parser, "--startup-timeout", type=float, default=600.0, help="seconds to wait for every service to be ready")
    add(parser, "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level of every service")
    cli_args.add_log_json_flag(parser)
    security.add_arguments(parser, grpc_server=True)  # passed on to every service


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the launcher dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _spawn(name: str, argv: list[str], address: str, health_service: str | None) -> Child:
    command = [sys.executable, "-m", "services.cli", *argv]
    # A new session: Ctrl-C in the terminal reaches only the launcher, which
    # then stops the children in order. If the launcher is killed outright,
    # the children are told to stop too.
    process = subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_parent)
    return Child(name=name, process=process, address=address, health_service=health_service)


def _start_children(args: argparse.Namespace) -> list[Child]:
    # Children get the model as the user named it: a preset resolves to the
    # checkpoint built above (same cache directory) and keeps its served name.
    common = ["--model", args.model or "tiny", "--host", args.host, "--log-level", args.log_level,
              "--log-json" if args.log_json else "--no-log-json"]
    device = ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
    children = []
    encoder_addresses, pd_addresses = [], []
    for i in range(0 if args.colocated else args.encoders):
        port = args.encoder_base_port + i
        address = f"{args.host}:{port}"
        encoder_addresses.append(address)
        metrics_port = _metrics_port(args.encoder_metrics_base_port, i)
        argv = ["encoder", *common, *device, "--port", str(port), "--metrics-port", metrics_port]
        argv += security.forward_argv(args, grpc_server=True)
        children.append(_spawn(f"encoder-{i}", argv, address, "epd.v1.Encoder"))
    for j in range(args.pds):
        port = args.pd_base_port + j
        address = f"{args.host}:{port}"
        pd_addresses.append(address)
        metrics_port = _metrics_port(args.pd_metrics_base_port, j)
        argv = ["pd", *common, *device, "--port", str(port), "--metrics-port", metrics_port]
        argv += security.forward_argv(args, grpc_server=True)
        if args.colocated:
            argv += ["--encoder", "local"]
            encoder_addresses.append(address)  # the PD serves epd.v1.Encoder on its own port
        children.append(_spawn(f"pd-{j}", argv, address, "epd.v1.PrefillDecode"))
    proxy_argv = [
        "proxy", *common, "--port", str(args.port),
        "--pd", ",".join(pd_addresses), "--encoder", ",".join(encoder_addresses),
        "--pd-policy", args.pd_policy, "--encoder-policy", args.encoder_policy,
        *security.forward_argv(args, grpc_server=False),
    ]
    children.append(_spawn("proxy", proxy_argv, f"{args.host}:{args.port}", None))
    return children


def _metrics_port(base: int, index: int) -> str:
    return str(base + index if base >= 0 else -1)


def _listening_ports(args: argparse.Namespace) -> list[int]:
    """Every port the cluster would bind: the proxy's, each gRPC server's, each /metrics endpoint's."""
    num_encoders = 0 if args.colocated else args.encoders
    ranges = [(args.encoder_base_port, num_encoders), (args.pd_base_port, args.pds)]
    if args.encoder_metrics_base_port >= 0:
        ranges.append((args.encoder_metrics_base_port, num_encoders))
    if args.pd_metrics_base_port >= 0:
        ranges.append((args.pd_metrics_base_port, args.pds))
    return [args.port, *(base + i for base, count in ranges for i in range(count))]


def _http_ready(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


async def _wait_ready(
    children: list[Child], timeout: float, stop: dict, transport: security.InternalSecurity = security.NO_SECURITY
) -> None:
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending and not stop["requested"]:
        for child in list(pending):
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.process.returncode} during start-up")
            if child.health_service is not None:
                ready = await grpc_utils.check_health(child.address, child.health_service, security=transport)
            else:
                ready = await asyncio.to_thread(_http_ready, child.address)
            if ready:
                print(f"  {child.name:<10} ready on {child.address}", flush=True)
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout:.0f}s: {', '.join(c.name for c in pending)}")
        await asyncio.sleep(0.3)


def stop_children(children: list[Child], grace: float = 30.0) -> None:
    """SIGTERM in order (proxy, encoders, PDs), then SIGKILL whatever outlives ``grace``."""
    order = sorted(children, key=lambda c: {"proxy": 0, "encoder": 1}.get(c.name.split("-")[0], 2))
    for child in order:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
            try:
                child.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def run(args: argparse.Namespace) -> int:
    from services.common.models import ensure_model
    from services.common.models.startup import refuse_unservable_model

    if args.colocated and args.pds != 1:
        # The proxy picks an encoder by image hash, not by PD: with several
        # colocated PDs an image could be sent to a PD that holds no reservation.
        print("epd: --colocated runs exactly one PD (use --pds 1)", file=sys.stderr, flush=True)
        return 2
    ports = _listening_ports(args)
    if len(set(ports)) != len(ports):
        print("epd: two services would listen on the same port; move a --*-base-port or turn metrics off (-1)",
              file=sys.stderr, flush=True)
        return 2
    try:
        transport = security.from_args(args)  # unreadable files fail here, before any child starts
    except ValueError as error:
        print(f"epd: {error}", file=sys.stderr, flush=True)
        return 2
    print("epd: preparing model ...", flush=True)
    model_dir = str(ensure_model(args.model or None, progress=lambda msg: print(f"  {msg}", flush=True)))
    if refuse_unservable_model(model_dir, "epd") is not None:
        return 2   # before any child starts: one line, no traceback
    print(f"epd: model {model_dir}", flush=True)
    if args.colocated:
        print("epd: starting 1 colocated PD (vision tower inside) and the proxy ...", flush=True)
    else:
        print(f"epd: starting {args.encoders} encoder(s), {args.pds} PD(s) and the proxy ...", flush=True)
    children = _start_children(args)
    stop = {"requested": False}

    def request_stop(signum, frame):  # noqa: ARG001 - signal handler signature
        stop["requested"] = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        asyncio.run(_wait_ready(children, args.startup_timeout, stop, transport))
        if stop["requested"]:
            return 130
        print(f"epd: cluster ready. OpenAI API at http://{args.host}:{args.port}/v1  (Ctrl-C to stop)", flush=True)
        while not stop["requested"]:
            for child in children:
                if child.process.poll() is not None:
                    print(f"epd: {child.name} exited with code {child.process.returncode}; stopping", flush=True)
                    return 1
            time.sleep(0.5)
        print("epd: stopping ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as error:
        print(f"epd: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_children(children)
        print("epd: stopped", flush=True)


__all__ = ["add_arguments", "run", "stop_children"]

if os.name != "posix":  # pragma: no cover
    raise ImportError("epd up supports POSIX systems only")

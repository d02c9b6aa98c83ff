"""``epd up``: the whole cluster as local processes, supervised.

Starts N encoders and M PDs, then the proxy in front of them, waits until
every one reports ready and prints the URL. From then on a child that exits
is restarted on its port with backoff while the others keep serving, and
so is one that stops answering its health RPCs (``services/supervisor.py``);
a service that crash-loops is left down, named in one log line, while the
others serve. ``epd up`` itself stops on Ctrl-C / SIGTERM, or when the
proxy or every PD crash-loops (nothing could serve), saying which and why.
Stopping goes in order: proxy first (no new work arrives), then encoders,
then PDs.

Internal security is on by default: unless a token is given
(``--internal-token-file`` / ``$EPD_INTERNAL_TOKEN``) or
``--no-auto-internal-token`` is set, a random token is generated for this
run and handed to each child on an inherited pipe (never on a command line,
where ``ps`` would show it, nor in its environment, which it would keep for
life and pass on to whatever it starts: ``services/common/secret_pipe.py``). Every ``/metrics`` endpoint listens on
``--metrics-host`` (loopback by default), whatever ``--host`` is.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import signal
import sys
import urllib.error
import urllib.request

from services.common import cli_args, grpc_utils, launch_proof, security
from services.common.metrics_http import MetricsHttpServer
from services.common.ports import DEFAULT_ENCODER_PORT, DEFAULT_PD_PORT
from services.launcher_metrics import LauncherMetrics
from services.supervisor import (
    HealthPolicy,
    RestartPolicy,
    ServiceSpec,
    StartupFailed,
    Supervisor,
)

DEFAULT_LAUNCHER_METRICS_PORT = 9300
"""``epd up``'s own ``/metrics`` (restarts per service); encoders use 91xx and PDs 92xx."""

DEFAULT_PROXY_METRICS_PORT = 9099
"""The proxy's scrape port under ``epd up`` (its ``--metrics-port``): its public port serves no ``/metrics``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = cli_args.add_flag
    add(
        parser,
        "--model",
        default="",
        help="checkpoint directory, preset name (tiny, bench, qwen2.5-vl-tiny, ...; see epd make-model) or hub id of a LLaVA, Qwen2-VL or Qwen2.5-VL checkpoint; default: the tiny model, built on first use",
    )
    add(parser, "--encoders", type=int, default=1, help="number of encoder processes")
    add(parser, "--pds", type=int, default=1, help="number of PD processes")
    add(
        parser,
        "--prefills",
        type=int,
        default=0,
        help="E+P+D: this many prefill PDs (epd pd --role prefill) in place of --pds; needs --decodes",
    )
    add(parser, "--decodes", type=int, default=0, help="E+P+D: this many decode PDs (epd pd --role decode)")
    add(
        parser,
        "--pd-policy",
        default="least-loaded",
        choices=["least-loaded", "round-robin"],
        help="proxy: how a PD is chosen (other proxy flags: set their EPD_* variables)",
    )
    add(
        parser,
        "--encoder-policy",
        default="rendezvous",
        choices=["rendezvous", "least-loaded", "round-robin"],
        help="proxy: how an encoder is chosen for an image",
    )
    add(
        parser,
        "--colocated",
        default=False,
        help="baseline mode: no encoder processes; the PD loads the vision tower and encodes inside its step loop like a monolithic engine (needs --pds 1)",
    )
    add(parser, "--host", default="127.0.0.1", help="address every service listens on")
    add(parser, "--port", type=int, default=8000, help="proxy HTTP port")
    add(
        parser, "--encoder-base-port", type=int, default=DEFAULT_ENCODER_PORT, help="encoder i listens on this port + i"
    )
    add(parser, "--pd-base-port", type=int, default=DEFAULT_PD_PORT, help="PD j listens on this port + j")
    add(
        parser,
        "--encoder-metrics-base-port",
        type=int,
        default=9101,
        help="encoder i serves Prometheus /metrics on this port + i (-1 = off)",
    )
    add(
        parser,
        "--pd-metrics-base-port",
        type=int,
        default=9201,
        help="PD j serves Prometheus /metrics on this port + j (-1 = off)",
    )
    add(
        parser,
        "--proxy-metrics-port",
        type=int,
        default=DEFAULT_PROXY_METRICS_PORT,
        help="the proxy serves Prometheus /metrics on this port (on --metrics-host; behind the internal token "
        "with --metrics-require-token), not on its public port (-1 = on the public port, behind an API key "
        "if one is set)",
    )
    add(
        parser,
        "--launcher-metrics-port",
        type=int,
        default=DEFAULT_LAUNCHER_METRICS_PORT,
        help="epd up's own /metrics: epd_launcher_restarts_total and epd_launcher_service_up per service (-1 = off)",
    )
    add(
        parser,
        "--metrics-host",
        default="127.0.0.1",
        help="address of every encoder, PD, proxy and launcher /metrics endpoint (loopback keeps them off the network "
        "whatever --host is)",
    )
    add(parser, "--device", default="auto", help="torch device for encoders and PDs")
    add(parser, "--dtype", default="auto", help="dtype for encoders and PDs")
    add(parser, "--threads", type=int, default=0, help="torch threads per process (0 = torch default)")
    add(
        parser,
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every service to be ready; a service restarted later that is not ready "
        "within this long is killed and counts as one more exit",
    )
    defaults = RestartPolicy()
    add(
        parser,
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        help="restarts of one service allowed within --restart-window-s; one more exit is a crash loop: that "
        "service stays down while the others serve (epd up stops when the proxy or every PD is down; "
        "0 = never restart)",
    )
    add(
        parser,
        "--restart-window-s",
        type=float,
        default=defaults.window_s,
        help="sliding window, seconds, over which a service's restarts are counted",
    )
    add(
        parser,
        "--restart-backoff-s",
        type=float,
        default=defaults.backoff_s,
        help="delay before the first restart in a window; it doubles with each further restart (at most 30 s)",
    )
    health = HealthPolicy()
    add(
        parser,
        "--health-interval-s",
        type=float,
        default=health.interval_s,
        help="seconds between liveness RPCs to each running service (gRPC health; the proxy: HTTP /health)",
    )
    add(
        parser,
        "--health-timeout-s",
        type=float,
        default=health.timeout_s,
        help="a liveness RPC not answered within this long failed",
    )
    add(
        parser,
        "--health-failures",
        type=int,
        default=health.max_failures,
        help="consecutive failed liveness RPCs after which a running service is killed as hung (e.g. SIGSTOP) and "
        "restarted (0 = liveness by process only)",
    )
    add(
        parser,
        "--auto-internal-token",
        default=True,
        help="generate a random internal token for the children when none is given (--internal-token-file or "
        "$EPD_INTERNAL_TOKEN); --no-auto-internal-token runs them without one",
    )
    add(
        parser,
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level of every service",
    )
    cli_args.add_log_json_flag(parser)
    security.add_arguments(parser, grpc_server=True)  # passed on to every service
    security.add_metrics_arguments(parser)


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    """The restart flags as a policy (ValueError when invalid)."""
    return RestartPolicy(
        max_restarts=args.max_restarts,
        window_s=args.restart_window_s,
        backoff_s=args.restart_backoff_s,
        max_backoff_s=max(30.0, args.restart_backoff_s),
    )


def health_policy(args: argparse.Namespace) -> HealthPolicy:
    """The liveness flags as a policy (ValueError when invalid)."""
    return HealthPolicy(
        interval_s=args.health_interval_s, timeout_s=args.health_timeout_s, max_failures=args.health_failures
    )


def service_specs(args: argparse.Namespace, env: dict[str, str] | None = None) -> list[ServiceSpec]:
    """Every child of ``epd up`` in start order: encoders, PDs, then the proxy.

    ``env`` is added to each child's environment (the generated token, the
    metrics switch; the spawner moves the token onto a pipe, ``secret_pipe``). Children get the model as the user named it: a preset
    resolves to the checkpoint built by the launcher (same cache directory)
    and keeps its served name.
    """
    env = dict(env or {})
    common = [
        "--model",
        args.model or "tiny",
        "--host",
        args.host,
        "--log-level",
        args.log_level,
        "--log-json" if args.log_json else "--no-log-json",
    ]
    device = ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]

    def grpc_service(
        kind: str, index: int, base_port: int, metrics_base_port: int, health_service: str, *extra: str
    ) -> ServiceSpec:
        argv = [
            kind,
            *common,
            *device,
            "--port",
            str(base_port + index),
            "--metrics-port",
            _metrics_port(metrics_base_port, index),
            "--metrics-host",
            args.metrics_host,
            *security.forward_argv(args, grpc_server=True),
            *extra,
        ]
        return ServiceSpec(f"{kind}-{index}", tuple(argv), f"{args.host}:{base_port + index}", health_service, env)

    # Encoders push only to this cluster's PDs (``epd encoder --pd-allow``), whatever an Encode names.
    roles = pd_roles(args)
    prefill_ports = [args.pd_base_port + j for j, role in enumerate(roles) if role != "decode"]
    # Prefill PDs push KV only to this cluster's decode PDs (``epd pd --decode-allow``).
    decode_ports = [f"{args.host}:{args.pd_base_port + j}" for j, role in enumerate(roles) if role == "decode"]
    pd_allow = ("--pd-allow", ",".join(f"{args.host}:{port}" for port in prefill_ports))
    specs = [
        grpc_service("encoder", i, args.encoder_base_port, args.encoder_metrics_base_port, "epd.v1.Encoder", *pd_allow)
        for i in range(0 if args.colocated else args.encoders)
    ]
    specs += [
        grpc_service(
            "pd",
            j,
            args.pd_base_port,
            args.pd_metrics_base_port,
            "epd.v1.PrefillDecode",
            *(["--encoder", "local"] if args.colocated else []),
            *(["--role", role] if role != "both" else []),
            *(["--decode-allow", ",".join(decode_ports)] if role == "prefill" else []),
        )
        for j, role in enumerate(roles)
    ]
    pd_addresses = [f"{args.host}:{port}" for port in prefill_ports]
    decode_addresses = [spec.address for spec in specs if spec.kind == "pd" and spec.address not in pd_addresses]
    # Colocated: each PD serves epd.v1.Encoder on its own port.
    encoder_addresses = pd_addresses if args.colocated else [spec.address for spec in specs if spec.kind == "encoder"]
    proxy_argv = [
        "proxy",
        *common,
        "--port",
        str(args.port),
        "--pd",
        ",".join(pd_addresses),
        "--encoder",
        ",".join(encoder_addresses),
        *(["--decode", ",".join(decode_addresses)] if decode_addresses else []),
        "--pd-policy",
        args.pd_policy,
        "--encoder-policy",
        args.encoder_policy,
        "--metrics-port",
        str(args.proxy_metrics_port),
        "--metrics-host",
        args.metrics_host,
        *security.forward_argv(args, grpc_server=False),
    ]
    specs.append(ServiceSpec("proxy", tuple(proxy_argv), f"{args.host}:{args.port}", None, env))
    return specs


def _metrics_port(base: int, index: int) -> str:
    return str(base + index if base >= 0 else -1)


def _listening_ports(args: argparse.Namespace) -> list[int]:
    """Every port the cluster would bind: the proxy's, each gRPC server's, each /metrics endpoint's."""
    num_encoders = 0 if args.colocated else args.encoders
    num_pds = len(pd_roles(args))
    ranges = [(args.encoder_base_port, num_encoders), (args.pd_base_port, num_pds)]
    if args.encoder_metrics_base_port >= 0:
        ranges.append((args.encoder_metrics_base_port, num_encoders))
    if args.pd_metrics_base_port >= 0:
        ranges.append((args.pd_metrics_base_port, num_pds))
    if args.launcher_metrics_port >= 0:
        ranges.append((args.launcher_metrics_port, 1))
    if args.proxy_metrics_port >= 0:
        ranges.append((args.proxy_metrics_port, 1))
    return [args.port, *(base + i for base, count in ranges for i in range(count))]


def launcher_security(
    args: argparse.Namespace, environ: dict[str, str] | None = None
) -> tuple[security.InternalSecurity, dict[str, str]]:
    """The transport ``epd up`` uses, and what it adds to its children's environment.

    A fresh token is generated unless one is given or ``--no-auto-internal-token``
    is set; ``--metrics-require-token`` then applies to it (ValueError without one).
    """
    given = security.from_args(argparse.Namespace(**{**vars(args), "metrics_require_token": False}), environ)
    env = {}
    if given.token is None and args.auto_internal_token:
        env[security.TOKEN_ENV] = secrets.token_urlsafe(32)
    if args.metrics_require_token:
        env[cli_args.env_name("--metrics-require-token")] = "1"
    transport = dataclasses.replace(
        given,
        token=given.token or env.get(security.TOKEN_ENV),
        metrics_auth=args.metrics_require_token,
        launch_key=None,  # the launcher proves nothing and checks its children itself (``Supervisor``)
        peer_launch_keys=(),
    )
    return transport, env


def _http_health(address: str, launch_key: str, timeout_s: float) -> int | None:
    """The status of the proxy's ``/health`` when the listener proved ``launch_key``, else None.

    The challenge travels as a request header and the proof as a response header, as on gRPC
    (``services/common/launch_proof.py``); any status counts, a 503 included.
    """
    challenge = launch_proof.new_challenge()
    request = urllib.request.Request(
        f"http://{address}/health", headers={launch_proof.CHALLENGE_METADATA_KEY: challenge}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            status, headers = reply.status, reply.headers
    except urllib.error.HTTPError as error:
        status, headers = error.code, error.headers
    except OSError:
        return None
    if not launch_proof.verify(launch_key, challenge, list(headers.items())):
        return None
    return status


def _http_ready(address: str, launch_key: str) -> bool:
    return _http_health(address, launch_key, 2.0) == 200


def _http_answers(address: str, launch_key: str, timeout_s: float) -> bool:
    """Whether the proxy answers ``/health`` at all: a 503 (no PD ready) is still a live proxy."""
    return _http_health(address, launch_key, timeout_s) is not None


def _alive_check(transport: security.InternalSecurity, timeout_s: float):
    """Liveness by RPC: gRPC health ``""`` (NOT_SERVING once a PD's engine is dead or stuck), the proxy's HTTP.

    The child must also prove its launch key (``launch_proof``), and no token is sent on these calls.
    """

    async def is_alive(spec: ServiceSpec, launch_key: str) -> bool:
        if spec.health_service is not None:
            return await grpc_utils.check_health(
                spec.address, "", timeout=timeout_s, security=transport, launch_key=launch_key
            )
        return await asyncio.to_thread(_http_answers, spec.address, launch_key, timeout_s)

    return is_alive


def _ready_check(transport: security.InternalSecurity):
    """Readiness: SERVING for the child's service (the proxy: ``/health`` 200), from a listener that proves
    the child's launch key."""

    async def is_ready(spec: ServiceSpec, launch_key: str) -> bool:
        if spec.health_service is not None:
            return await grpc_utils.check_health(
                spec.address, spec.health_service, timeout=1.0, security=transport, launch_key=launch_key
            )
        return await asyncio.to_thread(_http_ready, spec.address, launch_key)

    return is_ready


async def _supervise(args: argparse.Namespace, supervisor: Supervisor, metrics_token: str | None) -> int:
    """Runs the cluster until a stop signal (0, or 130 during start-up) or a failure (1)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics_http = None
    if args.launcher_metrics_port >= 0:
        try:
            metrics_http = await MetricsHttpServer.start(
                args.metrics_host, args.launcher_metrics_port, supervisor.metrics.render, token=metrics_token
            )
        except OSError as error:
            print(
                f"epd: cannot serve the launcher's /metrics on port {args.launcher_metrics_port}: {error.strerror}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    try:
        supervisor.start_all()
        await supervisor.wait_ready(args.startup_timeout, stop)
        if stop.is_set():
            return 130
        print(f"epd: cluster ready. OpenAI API at http://{args.host}:{args.port}/v1  (Ctrl-C to stop)", flush=True)
        crash = await supervisor.supervise(stop)
        if crash is not None:  # the supervisor has said which service and why
            print(f"epd: nothing can serve without {crash.name}; stopping the cluster", file=sys.stderr, flush=True)
            return 1
        print("epd: stopping ...", flush=True)
        return 0
    except StartupFailed as error:
        print(f"epd: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        if metrics_http is not None:
            await metrics_http.stop()


def pd_roles(args: argparse.Namespace) -> list[str]:
    """The role of each PD process, in port order: ``--pds`` of both, or ``--prefills`` then ``--decodes``."""
    if args.prefills or args.decodes:
        return ["prefill"] * args.prefills + ["decode"] * args.decodes
    return ["both"] * args.pds


def _usage_error(args: argparse.Namespace) -> str | None:
    if (args.prefills > 0) != (args.decodes > 0) or args.prefills < 0 or args.decodes < 0:
        return "--prefills and --decodes go together (E+P+D needs at least one of each)"
    if args.prefills and (args.colocated or args.pds != 1):
        return "--prefills/--decodes replace --pds and cannot be --colocated"
    if args.colocated and args.pds != 1:
        # The proxy picks an encoder by image hash, not by PD: with several
        # colocated PDs an image could be sent to a PD that holds no reservation.
        return "--colocated runs exactly one PD (use --pds 1)"
    ports = _listening_ports(args)
    if len(set(ports)) != len(ports):
        return "two services would listen on the same port; move a --*-base-port or turn metrics off (-1)"
    return None


def run(args: argparse.Namespace) -> int:
    from services.common.models import ensure_model
    from services.common.models.startup import refuse_unservable_model

    problem = _usage_error(args)
    try:
        policy = restart_policy(args)
        health = health_policy(args)
        transport, env = launcher_security(args)  # unreadable files fail here, before any child starts
    except ValueError as error:
        problem = problem or str(error)
    if problem:
        print(f"epd: {problem}", file=sys.stderr, flush=True)
        return 2
    print("epd: preparing model ...", flush=True)
    model_dir = str(ensure_model(args.model or None, progress=lambda msg: print(f"  {msg}", flush=True)))
    if refuse_unservable_model(model_dir, "epd") is not None:
        return 2  # before any child starts: one line, no traceback
    print(f"epd: model {model_dir}", flush=True)
    if args.colocated:
        print("epd: starting 1 colocated PD (vision tower inside) and the proxy ...", flush=True)
    else:
        print(f"epd: starting {args.encoders} encoder(s), {len(pd_roles(args))} PD(s) and the proxy ...", flush=True)
    if security.TOKEN_ENV in env:
        print(
            "epd: internal calls carry a token generated for this run (--no-auto-internal-token turns it off)",
            flush=True,
        )
    supervisor = Supervisor(
        service_specs(args, env),
        policy,
        is_ready=_ready_check(transport),
        metrics=LauncherMetrics(),
        ready_timeout_s=args.startup_timeout,
        is_alive=_alive_check(transport, health.timeout_s),
        health=health,
    )
    try:
        return asyncio.run(_supervise(args, supervisor, transport.metrics_token))
    finally:
        supervisor.stop_all()
        print("epd: stopped", flush=True)


__all__ = ["add_arguments", "launcher_security", "run", "service_specs"]

if os.name != "posix":  # pragma: no cover
    raise ImportError("epd up supports POSIX systems only")

"""``epd up``: the whole cluster as local processes, supervised.

Starts N encoders and M PDs, then the proxy in front of them, waits until
every one reports ready and prints the URL. From then on a child that exits
is restarted on its port with backoff while the others keep serving, and
so is one that stops answering its health RPCs (``supervisor.py``);
a service that crash-loops is left down, named in one log line, while the
others serve. ``epd up`` itself stops on Ctrl-C / SIGTERM, or when the
proxy or every PD crash-loops (nothing could serve), saying which and why.
Stopping goes in order: proxy first (no new work arrives), then encoders,
then PDs, the children of one tier together; each drains what it has in
flight, so an idle cluster stops in about a second.

Internal security is on by default: unless a token is given
(``--internal-token-file`` / ``$EPD_INTERNAL_TOKEN``) or
``--no-auto-internal-token`` is set, a random token is generated for this
run and handed to each child on an inherited pipe (never on a command line,
where ``ps`` would show it, nor in its environment, which it would keep for
life and pass on to whatever it starts: ``services/common/secret_pipe.py``). Every ``/metrics`` endpoint listens on
``--metrics-host`` (loopback by default), whatever ``--host`` is.

Before anything starts, every port the cluster will bind is checked: two
services on one port, or a port another process holds, ends ``epd up`` with
one line naming the port and its flag (exit 2); ``--port-offset`` moves every
port at once. While the cluster starts, each service is announced as it
becomes ready, with the time it took.

The flags are defined in ``flags.py``, the children they make in
``specs.py`` and their ports in ``ports.py``; this module checks the flags,
probes the children (readiness, liveness, launch proof) and runs the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import signal
import sys
import time
import urllib.error
import urllib.request

from services.common import cli_args, grpc_utils, launch_proof, security
from services.common.metrics_http import MetricsHttpServer
from services.launcher import ports
from services.launcher.flags import add_arguments, health_policy, restart_policy, with_port_offset
from services.launcher.metrics import LauncherMetrics
from services.launcher.specs import ServiceSpec, pd_roles, service_specs
from services.launcher.supervisor import StartupFailed, Supervisor

ROUTES_TO_ALL_TIMEOUT_S = 10.0
"""How long ``cluster ready`` waits, after every service's own ready line, for the proxy to see them all: its
health watch retries a service that was not up yet with backoff (at most 2 s between tries)."""


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


def _http_health(address: str, launch_key: str, timeout_s: float) -> tuple[int, bytes] | None:
    """The status and body of the proxy's ``/health`` when the listener proved ``launch_key``, else None.

    The challenge travels as a request header and the proof as a response header, as on gRPC
    (``services/common/launch_proof.py``); any status counts, a 503 included.
    """
    challenge = launch_proof.new_challenge()
    request = urllib.request.Request(
        f"http://{address}/health", headers={launch_proof.CHALLENGE_METADATA_KEY: challenge}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            status, headers, body = reply.status, reply.headers, reply.read(1 << 20)
    except urllib.error.HTTPError as error:
        status, headers, body = error.code, error.headers, b""
    except OSError:
        return None
    if not launch_proof.verify(launch_key, challenge, list(headers.items())):
        return None
    return status, body


def _http_ready(address: str, launch_key: str) -> bool:
    answer = _http_health(address, launch_key, 2.0)
    return answer is not None and answer[0] == 200


def _http_answers(address: str, launch_key: str, timeout_s: float) -> bool:
    """Whether the proxy answers ``/health`` at all: a 503 (no PD ready) is still a live proxy."""
    return _http_health(address, launch_key, timeout_s) is not None


def _http_routes_to_all(address: str, launch_key: str) -> bool:
    """Whether the proxy's ``/health`` reports every encoder and PD it knows as ready (routable)."""
    answer = _http_health(address, launch_key, 2.0)
    if answer is None or answer[0] != 200:
        return False
    try:
        report = json.loads(answer[1])
        return all(all(ready.values()) for kind, ready in report.items() if kind != "status")
    except (ValueError, AttributeError):
        return False


async def _wait_proxy_routes_to_all(supervisor: Supervisor, timeout_s: float, stop: asyncio.Event) -> bool:
    """Until the proxy routes to every instance (its health watch notices a newly ready one within a few
    seconds of its own ready line), so that ``cluster ready`` means what it says; False after ``timeout_s``."""
    proxies = [c for c in supervisor.children if c.spec.kind == "proxy"]
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        answers = await asyncio.gather(
            *(asyncio.to_thread(_http_routes_to_all, c.spec.address, c.launch_key) for c in proxies)
        )
        if all(answers):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return False


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


def _prepare_model(model: str) -> str | None:
    """The checkpoint directory (or hub id) of ``--model``, a missing preset built first; None after one line on
    stderr when it cannot be served.

    Torch-free, like the proxy's own check: a preset is built by ``epd make-model`` in a child process
    (its progress goes to this output) and only the checkpoint's ``config.json`` is read, so ``epd up``
    neither waits for torch and transformers to import nor pays for tearing them down at exit.
    """
    from services.common.models.cache import ensure_model_in_child
    from services.common.models.startup import refuse_unservable_model

    if refuse_unservable_model(model, "epd") is not None:
        return None
    return str(ensure_model_in_child(model or None))  # built by now: resolves to its directory


async def _supervise(
    args: argparse.Namespace, supervisor: Supervisor, metrics_token: str | None, started: float
) -> int:
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
        if not await _wait_proxy_routes_to_all(supervisor, ROUTES_TO_ALL_TIMEOUT_S, stop) and not stop.is_set():
            print("epd: the proxy does not see every service ready yet; it routes to those it sees", flush=True)
        if stop.is_set():
            return 130
        took = time.monotonic() - started
        print(
            f"epd: cluster ready in {took:.1f} s. OpenAI API at http://{args.host}:{args.port}/v1  (Ctrl-C to stop)",
            flush=True,
        )
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


def _usage_error(args: argparse.Namespace) -> str | None:
    if (args.prefills > 0) != (args.decodes > 0) or args.prefills < 0 or args.decodes < 0:
        return "--prefills and --decodes go together (E+P+D needs at least one of each)"
    if args.prefills and (args.colocated or args.pds != 1):
        return "--prefills/--decodes replace --pds and cannot be --colocated"
    if args.colocated and args.pds != 1:
        # The proxy picks an encoder by image hash, not by PD: with several
        # colocated PDs an image could be sent to a PD that holds no reservation.
        return "--colocated runs exactly one PD (use --pds 1)"
    return ports.clash(args)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    args = with_port_offset(args)
    problem = _usage_error(args)
    try:
        policy = restart_policy(args)
        health = health_policy(args)
        transport, env = launcher_security(args)  # unreadable files fail here, before any child starts
    except ValueError as error:
        problem = problem or str(error)
    problem = problem or ports.taken(args)  # before the model is prepared: no child has started
    if problem:
        print(f"epd: {problem}", file=sys.stderr, flush=True)
        return 2
    print("epd: preparing model ...", flush=True)
    model_dir = _prepare_model(args.model)
    if model_dir is None:
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
        return asyncio.run(_supervise(args, supervisor, transport.metrics_token, started))
    finally:
        supervisor.stop_all()
        print("epd: stopped", flush=True)


__all__ = ["add_arguments", "launcher_security", "run", "service_specs"]

if os.name != "posix":  # pragma: no cover
    raise ImportError("epd up supports POSIX systems only")

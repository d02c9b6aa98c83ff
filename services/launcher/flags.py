"""The ``epd up`` flags, and the restart and liveness policies they make.

Every flag of ``epd up`` is defined here (topology, ports, models and devices,
supervision, security) and grouped for ``--help`` (``HELP_GROUPS``);
``specs.py`` turns the parsed flags into the children to start, ``ports.py``
checks the ports they will bind and ``command.py`` runs them.
"""

from __future__ import annotations

import argparse

from services.common import cli_args, security
from services.common.ports import DEFAULT_ENCODER_PORT, DEFAULT_PD_PORT
from services.launcher.policy import HealthPolicy, RestartPolicy

DEFAULT_LAUNCHER_METRICS_PORT = 9300
"""``epd up``'s own ``/metrics`` (restarts per service); encoders use 91xx and PDs 92xx."""

DEFAULT_PROXY_METRICS_PORT = 9099
"""The proxy's scrape port under ``epd up`` (its ``--metrics-port``): its public port serves no ``/metrics``."""

PORT_FLAGS = (
    "--port",
    "--encoder-base-port",
    "--pd-base-port",
    "--encoder-metrics-base-port",
    "--pd-metrics-base-port",
    "--proxy-metrics-port",
    "--launcher-metrics-port",
)
"""Every flag that gives a port; ``--port-offset`` moves them all."""

HELP_GROUPS = (
    ("model and devices", ("--model", "--device", "--dtype", "--threads")),
    ("topology", ("--encoders", "--pds", "--prefills", "--decodes", "--colocated")),
    ("routing (the proxy's)", ("--pd-policy", "--encoder-policy")),
    ("ports and network", ("--host", "--port", "--port-offset", "--encoder-base-port", "--pd-base-port")),
    (
        "supervision",
        (
            "--startup-timeout",
            "--max-restarts",
            "--restart-window-s",
            "--restart-backoff-s",
            "--health-interval-s",
            "--health-timeout-s",
            "--health-failures",
        ),
    ),
    (
        "logging and metrics",
        (
            "--log-level",
            "--log-json",
            "--metrics-host",
            "--encoder-metrics-base-port",
            "--pd-metrics-base-port",
            "--proxy-metrics-port",
            "--launcher-metrics-port",
            "--metrics-require-token",
        ),
    ),
    ("internal transport security", ("--auto-internal-token",)),
)
"""``epd up --help`` in groups (each flag's definition below says what it does)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``epd up`` flag, grouped for ``--help``."""
    _add_topology_flags(parser)
    _add_port_flags(parser)
    _add_restart_flags(parser)
    _add_health_flags(parser)
    cli_args.add_log_json_flag(parser)
    security.add_arguments(parser, grpc_server=True)  # passed on to every service
    security.add_metrics_arguments(parser)
    cli_args.group_flags(parser, HELP_GROUPS)


def _add_topology_flags(parser: argparse.ArgumentParser) -> None:
    """What runs: the model, how many of each service, how requests are routed."""
    add = cli_args.add_flag
    add(
        parser,
        "--model",
        default="",
        shown_default=cli_args.DEFAULT_MODEL,
        help="checkpoint directory, preset name (tiny, bench, qwen2.5-vl-tiny, ...; see epd make-model) or hub id "
        "of a LLaVA, Qwen2-VL or Qwen2.5-VL checkpoint; empty = the tiny model, built on first use",
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
        default="cache-aware",
        choices=["cache-aware", "least-loaded", "round-robin"],
        help="proxy: how a PD is chosen; cache-aware = where the prompt's prefix and images are cached, weighed "
        "against load (other proxy flags, --pd-cache-weight among them: set their EPD_* variables)",
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


def _add_port_flags(parser: argparse.ArgumentParser) -> None:
    """Where each service listens, its gRPC or HTTP port and its ``/metrics``."""
    add = cli_args.add_flag
    add(parser, "--host", default="127.0.0.1", help="address every service listens on")
    add(parser, "--port", type=int, default=8000, help="proxy HTTP port")
    add(
        parser,
        "--port-offset",
        type=int,
        default=0,
        help="added to every port of the cluster (--port, each --*-base-port, each metrics port that is on), "
        "so that a second cluster runs beside the first: --port-offset 1 puts the proxy on 8001",
    )
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


def _add_restart_flags(parser: argparse.ArgumentParser) -> None:
    """How encoders and PDs run, and when a child that exited is started again."""
    add = cli_args.add_flag
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


def _add_health_flags(parser: argparse.ArgumentParser) -> None:
    """Liveness checks of running children, the internal token and the log level."""
    add = cli_args.add_flag
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


def with_port_offset(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--port-offset`` added to every port flag that is set (-1 = off and 0 stay as they are).

    The result keeps ``port_offset`` (for messages) and is marked shifted, so that shifting it again
    changes nothing.
    """
    offset = getattr(args, "port_offset", 0)
    if not offset or getattr(args, "ports_shifted", False):
        return args
    shifted = argparse.Namespace(**vars(args))
    for flag in PORT_FLAGS:
        name = flag.lstrip("-").replace("-", "_")
        if getattr(args, name) > 0:
            setattr(shifted, name, getattr(args, name) + offset)
    shifted.ports_shifted = True
    return shifted


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

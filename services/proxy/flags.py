"""``epd proxy``'s flags, and how ``--help`` groups them (``HELP_GROUPS``).

Every flag of ``epd proxy`` is defined here (backends, timeouts, routing,
logging) or, for what requests may carry and cost, in ``request_flags.py``.
They import nothing heavy, so ``--help`` stays fast; ``main.py`` turns the
parsed flags into a ``ProxyConfig`` and runs the HTTP server.
"""

from __future__ import annotations

import argparse

from services.common import cli_args, security
from services.common.ports import DEFAULT_ENCODER_PORT, DEFAULT_PD_PORT
from services.proxy.backends.cache_index import DEFAULT_MAX_BYTES
from services.proxy.backends.routing import DEFAULT_CACHE_WEIGHT, DEFAULT_PD_POLICY, ENCODER_POLICIES, PD_POLICIES
from services.proxy.config import MIB
from services.proxy.dispatch.image_window import DEFAULT_IMAGE_WINDOW
from services.proxy.request_flags import add_request_arguments

HELP_GROUPS = (
    ("model", ("--model", "--served-model-name")),
    ("network", ("--host", "--port", "--max-concurrency", "--keep-alive-timeout-s")),
    ("backends", ("--pd", "--decode", "--encoder", "--dns-refresh-s", "--load-poll-s")),
    (
        "routing and retries",
        (
            "--pd-policy",
            "--pd-cache-weight",
            "--pd-cache-index-mb",
            "--encoder-policy",
            "--encoder-saturation",
            "--pd-image-window",
            "--pd-attempts",
            "--encoder-attempts",
            "--breaker-failures",
            "--breaker-open-s",
        ),
    ),
    (
        "timeouts",
        (
            "--request-timeout",
            "--body-timeout-s",
            "--first-token-timeout-s",
            "--inter-token-timeout-s",
            "--encode-timeout-s",
            "--write-timeout-s",
            "--lease-ms",
            "--grace",
        ),
    ),
    (
        "request limits",
        (
            "--max-body-mb",
            "--max-messages",
            "--max-images",
            "--max-image-pixels",
            "--max-request-pixels",
            "--max-video-frames",
            "--max-video-seconds",
            "--max-video-bytes",
            "--max-model-len",
            "--max-tokens-limit",
            "--default-max-tokens",
            "--max-n",
            "--ignore-unknown-fields",
        ),
    ),
    ("remote media", ("--allowed-media-domains", "--media-timeout", "--max-media-mb")),
    (
        "preprocessing",
        (
            "--preprocess-threads",
            "--text-queue",
            "--image-threads",
            "--image-queue",
            "--video-threads",
            "--video-queue",
        ),
    ),
    (
        "clients and caches",
        (
            "--api-key",
            "--max-requests-per-client",
            "--max-tokens-per-client-per-minute",
            "--cache-isolation",
            "--hide-cache-details",
        ),
    ),
    (
        "logging and metrics",
        ("--log-level", "--log-json", "--metrics-port", "--metrics-host", "--metrics-require-token"),
    ),
    ("testing", ("--fault",)),
)
"""``epd proxy --help`` in groups."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the proxy flags (each also read from ``EPD_<FLAG>``)."""
    add = cli_args.add_flag
    _add_backend_arguments(parser)
    _add_timeout_arguments(parser)
    add_request_arguments(parser)
    _add_routing_arguments(parser)
    add(
        parser,
        "--api-key",
        default="",
        help="require 'Authorization: Bearer <key>' on /v1/* and /metrics; /health then names no backend to "
        "callers without it ('' = open; prefer the env variable)",
    )
    add(
        parser,
        "--allowed-media-domains",
        default="",
        help="comma-separated hosts whose https image URLs may be fetched ('*.example.com' = subdomains; '' = data URLs only)",
    )
    add(parser, "--media-timeout", type=float, default=10.0, help="timeout of one remote image fetch, seconds")
    add(parser, "--max-media-mb", type=float, default=16.0, help="largest remote image, MiB")
    add(parser, "--grace", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM")
    add(
        parser,
        "--fault",
        default="",
        help="TEST ONLY: inject faults: slow-decode-ms=N (every image decode sleeps N ms first); '' = none",
    )
    add(parser, "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    cli_args.add_log_json_flag(parser)
    add(
        parser,
        "--metrics-port",
        type=int,
        default=-1,
        help="serve Prometheus /metrics on this port instead of the public one, behind the internal token "
        "with --metrics-require-token (the way to scrape with that token: it never opens the public port); "
        "-1 = /metrics on the public port, behind --api-key when one is set",
    )
    add(parser, "--metrics-host", default="", help="address of the --metrics-port endpoint ('' = --host)")
    security.add_arguments(parser, grpc_server=False)
    security.add_metrics_arguments(parser)
    cli_args.group_flags(parser, HELP_GROUPS)


def _add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, where the proxy listens and the encoders and PDs it sends to."""
    add = cli_args.add_flag
    add(
        parser,
        "--model",
        default="",
        shown_default=cli_args.DEFAULT_MODEL,
        help="checkpoint directory, preset name or hub id (LLaVA, Qwen2-VL, Qwen2.5-VL); only its processor is loaded; empty = the built-in tiny model",
    )
    add(parser, "--host", default="127.0.0.1", help="HTTP address to listen on")
    add(parser, "--port", type=int, default=8000, help="HTTP port (0 = pick a free one)")
    add(
        parser,
        "--pd",
        default=f"127.0.0.1:{DEFAULT_PD_PORT}",
        help="comma-separated PD gRPC addresses; a host name stands for every address it resolves to",
    )
    add(
        parser,
        "--decode",
        default="",
        help="E+P+D: comma-separated decode instances (epd pd --role decode); --pd then lists prefill "
        "instances (--role prefill). Empty (default) = E+PD",
    )
    add(
        parser,
        "--encoder",
        default=f"127.0.0.1:{DEFAULT_ENCODER_PORT}",
        help="comma-separated encoder gRPC addresses, names as for --pd ('' = text only)",
    )
    add(parser, "--served-model-name", default="", help="model name clients use (default: the checkpoint's id)")


def _add_timeout_arguments(parser: argparse.ArgumentParser) -> None:
    """Deadlines of requests and of each step of one, and the HTTP server's connection limits."""
    add = cli_args.add_flag
    add(
        parser,
        "--request-timeout",
        type=float,
        default=300.0,
        help="end-to-end deadline of one request, seconds (X-Request-Timeout may shorten it)",
    )
    add(parser, "--max-body-mb", type=float, default=32.0, help="largest request body, MiB")
    add(
        parser,
        "--body-timeout-s",
        type=float,
        default=30.0,
        help="seconds a client may take to send its whole request body (also capped by the request's deadline); "
        "a slower one gets 408 and its connection is closed",
    )
    add(
        parser,
        "--first-token-timeout-s",
        type=float,
        default=0.0,
        help="seconds from a request's arrival to PD's first token (images' encoding included) before the "
        "generation is aborted with 504 (0 = off: only the request timeout applies)",
    )
    add(
        parser,
        "--inter-token-timeout-s",
        type=float,
        default=60.0,
        help="longest gap between two tokens from PD; a longer stall aborts the generation: a stream ends with "
        "an error event (code 'timeout') and [DONE], a whole response is a 504 (0 = off)",
    )
    add(
        parser,
        "--encode-timeout-s",
        type=float,
        default=300.0,
        help="longest an encoder may take to answer one Encode call; a longer one counts against that encoder's "
        "circuit breaker and the image moves to another encoder while the request's deadline allows (a deadline "
        "that runs out first is not the encoder's fault). On a CPU a 12 MP photo takes about a minute (0 = off)",
    )
    add(
        parser,
        "--write-timeout-s",
        type=float,
        default=30.0,
        help="longest one response write may wait for a client that stopped reading (never past the request's "
        "deadline plus 1 s); then the response is dropped, the generation aborted and epd_proxy_stalls_total"
        "{kind=write} counted (0 = only the deadline bounds it)",
    )
    add(
        parser,
        "--max-concurrency",
        type=int,
        default=2048,
        help="open connections plus requests in progress beyond which new requests get a plain 503 from the "
        "HTTP server (uvicorn's limit_concurrency; 0 = no limit)",
    )
    add(
        parser,
        "--keep-alive-timeout-s",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )


def _add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """How an encoder and a PD are chosen, retried and kept away from, and how backends are followed."""
    add = cli_args.add_flag
    add(
        parser,
        "--pd-policy",
        default=DEFAULT_PD_POLICY,
        choices=list(PD_POLICIES),
        help="how a PD is chosen: cache-aware = where the prompt's prefix and images are cached, weighed against "
        "load (docs: Routing); least-loaded; round-robin",
    )
    add(
        parser,
        "--pd-cache-weight",
        type=float,
        default=DEFAULT_CACHE_WEIGHT,
        help="cache-aware: a prompt token a PD would have to compute weighs this many tokens of its load "
        "(0 = token load alone; larger = conversations stay where their prefix is under more imbalance)",
    )
    add(
        parser,
        "--pd-cache-index-mb",
        type=int,
        default=DEFAULT_MAX_BYTES // MIB,
        help="cache-aware: memory bound of the index of what each PD's caches hold (least recent entries go first)",
    )
    add(
        parser,
        "--encoder-policy",
        default="rendezvous",
        choices=list(ENCODER_POLICIES),
        help="how an encoder is chosen for an image (rendezvous = cache affinity on the image hash)",
    )
    add(
        parser,
        "--encoder-saturation",
        type=int,
        default=16,
        help="images in flight on an encoder beyond which its rendezvous images go to the least-loaded one",
    )
    add(
        parser,
        "--pd-image-window",
        type=int,
        default=DEFAULT_IMAGE_WINDOW,
        help="image requests per PD between their Preallocate and their first token; more wait in the proxy, in "
        "arrival order, so that an encoder sharing PD's cores encodes the images of the prompts PD prefills next, "
        "not a whole burst ahead of them (docs: Routing). 0 = no bound: encoders on other machines than their PDs",
    )
    add(parser, "--pd-attempts", type=int, default=3, help="PDs one request may try before its first byte")
    add(parser, "--encoder-attempts", type=int, default=3, help="encoders one image may try")
    add(
        parser,
        "--breaker-failures",
        type=int,
        default=3,
        help="consecutive failures that open an instance's circuit breaker",
    )
    add(
        parser,
        "--breaker-open-s",
        type=float,
        default=2.0,
        help="seconds an open breaker keeps traffic away before a probe",
    )
    add(parser, "--load-poll-s", type=float, default=0.5, help="GetLoad polling period (0 = off)")
    add(parser, "--dns-refresh-s", type=float, default=5.0, help="re-resolution period of named backends")

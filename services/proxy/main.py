"""``epd proxy``: run the OpenAI-compatible HTTP proxy."""

from __future__ import annotations

import argparse
import signal
from typing import Any

from services.common import cli_args, security
from services.common.logs import setup_logging
from services.common.ports import DEFAULT_ENCODER_PORT, DEFAULT_PD_PORT
from services.proxy.backends.cache_index import DEFAULT_MAX_BYTES
from services.proxy.backends.routing import DEFAULT_CACHE_WEIGHT, DEFAULT_PD_POLICY, ENCODER_POLICIES, PD_POLICIES
from services.proxy.cache_isolation import CacheIsolation
from services.proxy.config import MIB, ProxyConfig
from services.proxy.faults import ProxyFaults

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


def _addresses(text: str) -> tuple[str, ...]:
    """A comma-separated list (addresses, domains) as a tuple, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the proxy flags (each also read from ``EPD_<FLAG>``)."""
    add = cli_args.add_flag
    defaults = ProxyConfig()
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
    add(parser, "--max-images", type=int, default=8, help="most images in one request")
    add(
        parser,
        "--max-messages",
        type=int,
        default=2048,
        help="most chat messages in one request (and 16 content parts a message), counted in the raw body before "
        "it is parsed, so a body of many small messages costs no parsing to refuse",
    )
    add(
        parser,
        "--max-video-frames",
        type=int,
        default=defaults.max_video_frames,
        help="most frames sampled of one video (the encoders' --max-video-frames must be no lower)",
    )
    add(
        parser,
        "--max-video-seconds",
        type=float,
        default=defaults.max_video_seconds,
        help="longest video, from its header and its frame count (the encoders' must be no lower)",
    )
    add(
        parser,
        "--max-video-bytes",
        type=int,
        default=defaults.max_video_bytes,
        help="largest video file (the encoders' must be no lower)",
    )
    add(
        parser,
        "--max-image-pixels",
        type=int,
        default=4096 * 4096,
        help="largest width x height of one image (checked before decoding)",
    )
    add(
        parser,
        "--max-request-pixels",
        type=int,
        default=2 * 4096 * 4096,
        help="largest width x height of all images of one request together (checked before decoding any)",
    )
    add(parser, "--max-model-len", type=int, default=0, help="prompt + completion tokens (0 = the model's; match PD's)")
    add(parser, "--max-tokens-limit", type=int, default=16384, help="largest max_tokens a client may ask for")
    add(parser, "--default-max-tokens", type=int, default=1024, help="max_tokens when the client does not set it")
    add(
        parser,
        "--lease-ms",
        type=int,
        default=0,
        help="lease of a request's image reservations on PD and (E+P+D) of its KV reservation on the "
        "decode PD, ms; 0 = the request's remaining deadline",
    )
    add(
        parser,
        "--preprocess-threads",
        type=int,
        default=2,
        help="threads for text work (chat template, tokenization); images have their own (--image-threads)",
    )
    add(
        parser,
        "--text-queue",
        type=int,
        default=64,
        help="text jobs that may wait for a thread; beyond it requests get 503 + Retry-After",
    )
    add(parser, "--image-threads", type=int, default=2, help="threads for image decoding, hashing and processing")
    add(
        parser,
        "--image-queue",
        type=int,
        default=64,
        help="requests whose images may wait for an image thread; beyond it they get 503 + Retry-After",
    )
    add(
        parser,
        "--video-threads",
        type=int,
        default=defaults.video_threads,
        help="threads decoding videos, a pool of their own (a decode stops at its request's deadline or when "
        "the client goes away)",
    )
    add(
        parser,
        "--video-queue",
        type=int,
        default=defaults.video_queue,
        help="requests whose videos may wait for a video thread; beyond it they get 503 + Retry-After",
    )
    add(parser, "--max-n", type=int, default=8, help="most choices (n) in one request")
    add(
        parser,
        "--ignore-unknown-fields",
        default=True,
        help="ignore request body fields this server does not know (top-level or nested), as vLLM does, "
        "instead of refusing them with a 400 (--no-ignore-unknown-fields); the response names them in the "
        "X-EPD-Ignored-Fields header and one line is logged (names only). Fields whose meaning this server "
        "knows and does not implement (OpenAI's, vLLM's) are refused either way unless they have their "
        "no-op value",
    )
    add(
        parser,
        "--cache-isolation",
        choices=[mode.value for mode in CacheIsolation],
        default=CacheIsolation.SHARED.value,
        help="which requests may be served from each other's cache entries (encoder and PD embedding caches, "
        "PD's prefix cache), whose speed tells a client what others sent: shared = all (as before); "
        "per-client = only the same client's, as --max-requests-per-client counts clients (the API key with "
        "--api-key, else the peer address). A request's cache_salt narrows this further either way",
    )
    add(
        parser,
        "--hide-cache-details",
        default=False,
        help="leave out of every response's usage what the caches did: prompt_tokens_details.cached_tokens and "
        "usage.epd's num_images_ready, num_encoder_cache_hits, num_pd_attempts and timings_ms, which tell a client "
        "whether another client sent the same image or prompt before (for servers shared by clients who must not "
        "learn that; response times still differ)",
    )
    add(
        parser,
        "--max-requests-per-client",
        type=int,
        default=0,
        help="requests in flight per client (the API key when --api-key is set, else the peer address; behind a "
        "load balancer that is the balancer's); a request with n choices counts as n; beyond it 429 (0 = off)",
    )
    add(
        parser,
        "--max-tokens-per-client-per-minute",
        type=int,
        default=0,
        help="token bucket per client over requested work (prompt tokens + max_tokens × n, charged at admission, "
        "unused completion tokens refunded at the end); beyond it 429 with Retry-After (0 = off)",
    )
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


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        pd_addresses=_addresses(args.pd),
        encoder_addresses=_addresses(args.encoder),
        decode_addresses=_addresses(args.decode),
        served_model_name=args.served_model_name or None,
        request_timeout_s=args.request_timeout,
        max_body_bytes=int(args.max_body_mb * MIB),
        body_timeout_s=args.body_timeout_s,
        first_token_timeout_s=args.first_token_timeout_s,
        inter_token_timeout_s=args.inter_token_timeout_s,
        encode_timeout_s=args.encode_timeout_s,
        write_timeout_s=args.write_timeout_s,
        max_concurrency=args.max_concurrency,
        keep_alive_timeout_s=args.keep_alive_timeout_s,
        max_images_per_request=args.max_images,
        max_messages=args.max_messages,
        max_image_pixels=args.max_image_pixels,
        max_request_pixels=args.max_request_pixels,
        max_video_frames=args.max_video_frames,
        max_video_seconds=args.max_video_seconds,
        max_video_bytes=args.max_video_bytes,
        max_model_len=args.max_model_len,
        max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=args.default_max_tokens,
        lease_ms=args.lease_ms,
        preprocess_threads=args.preprocess_threads,
        text_queue=args.text_queue,
        image_threads=args.image_threads,
        image_queue=args.image_queue,
        video_threads=args.video_threads,
        video_queue=args.video_queue,
        max_n=args.max_n,
        max_requests_per_client=args.max_requests_per_client,
        max_tokens_per_client_per_minute=args.max_tokens_per_client_per_minute,
        ignore_unknown_fields=args.ignore_unknown_fields,
        hide_cache_details=args.hide_cache_details,
        cache_isolation=CacheIsolation(args.cache_isolation),
        pd_policy=args.pd_policy,
        pd_cache_weight=args.pd_cache_weight,
        pd_cache_index_mb=args.pd_cache_index_mb,
        encoder_policy=args.encoder_policy,
        encoder_saturation=args.encoder_saturation,
        pd_attempts=args.pd_attempts,
        encoder_attempts=args.encoder_attempts,
        breaker_failures=args.breaker_failures,
        breaker_open_s=args.breaker_open_s,
        load_poll_s=args.load_poll_s,
        dns_refresh_s=args.dns_refresh_s,
        api_key=args.api_key or None,
        allowed_media_domains=_addresses(args.allowed_media_domains),
        media_timeout_s=args.media_timeout,
        max_media_bytes=int(args.max_media_mb * MIB),
        faults=ProxyFaults.parse(args.fault),
        security=security.from_args(args),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )


def uvicorn_limits(config: ProxyConfig) -> dict[str, Any]:
    """The HTTP server's own limits (``uvicorn.run`` keywords).

    ``limit_concurrency`` caps connections plus requests (uvicorn answers a
    plain 503 beyond it), which bounds what slow clients can hold: uvicorn
    has no timeout for reading headers, only h11's cap on their size
    (``h11_max_incomplete_event_size``, 16 KiB by default, kept). Body reads
    and response writes are bounded by the app (``--body-timeout-s``,
    ``--write-timeout-s``).
    """
    return {
        "limit_concurrency": config.max_concurrency or None,
        "timeout_keep_alive": config.keep_alive_timeout_s,
    }


def run(args: argparse.Namespace) -> int:
    """Serves until SIGINT/SIGTERM; uvicorn then stops accepting, lets requests finish
    for ``--grace`` seconds and runs the lifespan shutdown (channels closed)."""
    import uvicorn

    from services.common.models.startup import refuse_unservable_model
    from services.proxy.app import create_app

    if (code := refuse_unservable_model(args.model, "epd proxy")) is not None:
        return code

    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"epd proxy: {error}")
        return 2
    setup_logging(args.log_level, service="proxy", json_format=args.log_json)
    # uvicorn re-raises the signal that stopped it once it has drained; with
    # our own (no-op) handlers installed that ends in a clean exit 0 instead
    # of death by SIGTERM.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        log_config=None,  # keep setup_logging's format
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=args.grace,
        **uvicorn_limits(config),
    )
    return 0

"""``epd proxy``: run the OpenAI-compatible HTTP proxy.

The flags (``flags.py``) import nothing heavy (``--help`` stays fast); ``run``
imports uvicorn and the app.
"""

from __future__ import annotations

import argparse
import signal
from typing import Any

from services.common import security
from services.common.logs import setup_logging
from services.proxy.cache_isolation import CacheIsolation
from services.proxy.config import MIB, ProxyConfig
from services.proxy.faults import ProxyFaults
from services.proxy.flags import add_arguments

__all__ = ["add_arguments", "config_from_args", "run", "uvicorn_limits"]


def _addresses(text: str) -> tuple[str, ...]:
    """A comma-separated list (addresses, domains) as a tuple, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


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
        pd_image_window=args.pd_image_window,
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

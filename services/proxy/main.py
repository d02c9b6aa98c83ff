"""``epd proxy``: run the OpenAI-compatible HTTP proxy."""

from __future__ import annotations

import argparse

from services.common import cli_args
from services.common.logs import setup_logging
from services.proxy.config import MIB, ProxyConfig


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the proxy flags (each also read from ``EPD_<FLAG>``)."""
    add = cli_args.add_flag
    add(parser, "--model", default="", help="checkpoint directory or hub id; only its processor is loaded (default: the built-in tiny model)")
    add(parser, "--host", default="127.0.0.1", help="HTTP address to listen on")
    add(parser, "--port", type=int, default=8000, help="HTTP port (0 = pick a free one)")
    add(parser, "--pd", default="127.0.0.1:50061", help="comma-separated PD gRPC addresses")
    add(parser, "--encoder", default="127.0.0.1:50051", help="comma-separated encoder gRPC addresses ('' = text only)")
    add(parser, "--served-model-name", default="", help="model name clients use (default: the checkpoint's id)")
    add(parser, "--request-timeout", type=float, default=300.0, help="end-to-end deadline of one request, seconds")
    add(parser, "--max-body-mb", type=float, default=32.0, help="largest request body, MiB")
    add(parser, "--max-images", type=int, default=8, help="most images in one request")
    add(parser, "--max-image-pixels", type=int, default=4096 * 4096, help="largest width x height of one image (checked before decoding)")
    add(parser, "--max-model-len", type=int, default=0, help="prompt + completion tokens (0 = the model's; match PD's)")
    add(parser, "--max-tokens-limit", type=int, default=16384, help="largest max_tokens a client may ask for")
    add(parser, "--default-max-tokens", type=int, default=1024, help="max_tokens when the client does not set it")
    add(parser, "--lease-ms", type=int, default=0, help="Preallocate lease (0 = PD's default)")
    add(parser, "--preprocess-threads", type=int, default=2, help="threads for image decoding and tokenization")
    add(parser, "--grace", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM")
    add(parser, "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        pd_addresses=_addresses(args.pd),
        encoder_addresses=_addresses(args.encoder),
        served_model_name=args.served_model_name or None,
        request_timeout_s=args.request_timeout,
        max_body_bytes=int(args.max_body_mb * MIB),
        max_images_per_request=args.max_images,
        max_image_pixels=args.max_image_pixels,
        max_model_len=args.max_model_len,
        max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=args.default_max_tokens,
        lease_ms=args.lease_ms,
        preprocess_threads=args.preprocess_threads,
    )


def run(args: argparse.Namespace) -> int:
    """Serves until SIGINT/SIGTERM; uvicorn then stops accepting, lets requests finish
    for ``--grace`` seconds and runs the lifespan shutdown (channels closed)."""
    import uvicorn

    from services.proxy.app import create_app

    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"epd proxy: {error}")
        return 2
    setup_logging(args.log_level, service="proxy")
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        log_config=None,  # keep setup_logging's format
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=args.grace,
    )
    return 0

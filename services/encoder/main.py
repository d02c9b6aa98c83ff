"""``epd encoder``: command-line flags and the process entry point.

Shutdown: SIGTERM/SIGINT -> health NOT_SERVING -> ``stop(grace)`` -> exit 0.
Metrics: ``start_encoder`` serves ``epd_encoder_*`` on ``--metrics-port``
(``--metrics-host``, default ``--host``; -1 = off), behind the internal token
with ``--metrics-require-token``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from services.common import cli_args, grpc_utils, host_memory, security
from services.common.logs import setup_logging
from services.encoder.config import DEFAULT_METRICS_PORT, MIB, EncoderConfig
from services.encoder.faults import Faults
from services.encoder.pd_allow import PdAllowSpec

log = logging.getLogger(__name__)

KIB = 1 << 10

HELP_GROUPS = (
    ("model and devices", ("--model", "--device", "--dtype", "--threads", "--linear-backend")),
    ("network", ("--host", "--port")),
    (
        "batching and limits",
        (
            "--max-batch-images",
            "--max-wait-ms",
            "--max-pending",
            "--max-message-mib",
            "--cache-mib",
            "--accept-pixel-values",
        ),
    ),
    ("videos", ("--max-video-frames", "--max-video-seconds", "--max-video-bytes", "--video-threads", "--video-queue")),
    ("pushes to PDs", ("--pd-allow", "--max-outbound-mib", "--push-chunk-kib", "--push-timeout-s")),
    ("lifecycle", ("--warmup", "--grace", "--stall-timeout-s", "--liveness-timeout-s")),
    (
        "logging and metrics",
        ("--log-level", "--log-json", "--metrics-port", "--metrics-host", "--metrics-require-token"),
    ),
    ("testing", ("--fault",)),
)
"""``epd encoder --help`` in groups."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the encoder's flags (each also read from ``EPD_<FLAG>``)."""
    defaults = EncoderConfig()
    cli_args.add_common_flags(parser, port=defaults.port, metrics_port=DEFAULT_METRICS_PORT)
    add = cli_args.add_flag
    add(parser, "--metrics-host", default="", help="address of the /metrics endpoint ('' = --host)")
    add(
        parser,
        "--linear-backend",
        default=defaults.linear_backend,
        choices=["auto", "torch", "onednn", "kernel"],
        help="who runs the vision tower's linear layers on CPU for float32: kernel (a C kernel over weights "
        "packed at start, built with the C compiler), onednn or torch (services/common/cpu_linear.py); auto = "
        "kernel where it builds, else onednn where it works, else torch; torch on GPUs and for other dtypes",
    )
    add(
        parser,
        "--max-batch-images",
        type=int,
        default=defaults.max_batch_images,
        help="most images in one vision forward",
    )
    add(
        parser,
        "--max-wait-ms",
        type=float,
        default=defaults.max_wait_ms,
        help="how long a batch waits for more images after its first",
    )
    add(
        parser,
        "--max-pending",
        type=int,
        default=defaults.max_pending,
        help="most images queued or encoding; more are refused with RESOURCE_EXHAUSTED",
    )
    add(
        parser,
        "--max-message-mib",
        type=int,
        default=defaults.max_message_bytes // MIB,
        help="largest Encode message taken, in MiB; a bigger one is refused with RESOURCE_EXHAUSTED before it "
        "is parsed. The default is the proxy's default --max-body-mb (which bounds any image file it sends) "
        "plus 1 MiB for the rest of the call: raise both together",
    )
    add(
        parser,
        "--cache-mib",
        type=int,
        default=defaults.cache_bytes // MIB,
        help="embedding cache capacity in MiB (0 = off)",
    )
    add(
        parser,
        "--max-outbound-mib",
        type=int,
        default=defaults.max_outbound_bytes // MIB,
        help="most MiB of embedding pushes in flight",
    )
    add(
        parser,
        "--push-chunk-kib",
        type=int,
        default=defaults.push_chunk_bytes // KIB,
        help="largest PushEmbedding chunk in KiB (<= 1024)",
    )
    add(
        parser,
        "--push-timeout-s",
        type=float,
        default=defaults.push_timeout_s,
        help="push deadline when the Encode call has none",
    )
    add(
        parser,
        "--pd-allow",
        default="",
        help="the PDs an Encode may name, which alone this encoder dials (with the internal token): "
        "comma-separated host:port entries; a host name also allows every address it resolves to on that "
        "port (a Kubernetes headless service: pd-headless:21061); '*' = any address (warned at start-up); "
        "'' = loopback addresses only. Any other address is refused with PERMISSION_DENIED before any work",
    )
    add(
        parser,
        "--max-video-frames",
        type=int,
        default=defaults.max_video_frames,
        help="most frames sampled of one video (keep it equal to the proxy's --max-video-frames)",
    )
    add(
        parser,
        "--max-video-seconds",
        type=float,
        default=defaults.max_video_seconds,
        help="longest video (keep it equal to the proxy's --max-video-seconds)",
    )
    add(
        parser,
        "--max-video-bytes",
        type=int,
        default=defaults.max_video_bytes,
        help="largest video file (keep it equal to the proxy's --max-video-bytes)",
    )
    add(
        parser,
        "--video-threads",
        type=int,
        default=defaults.video_threads,
        help="videos decoded at once, on threads of their own (a decode stops at its call's deadline)",
    )
    add(
        parser,
        "--video-queue",
        type=int,
        default=defaults.video_queue,
        help="Encode calls with a video waiting for a decode thread; beyond it RESOURCE_EXHAUSTED",
    )
    add(parser, "--warmup", default=defaults.warmup, help="run a blank-image forward before reporting ready")
    add(
        parser,
        "--accept-pixel-values",
        default=defaults.accept_pixel_values,
        help="also take processed pixel tensors (older proxies); their mm_hash cannot be checked against the "
        "image, so any caller with the internal token could plant an embedding under another image's hash",
    )
    add(
        parser,
        "--grace",
        type=float,
        default=defaults.grace_s,
        help="seconds in-flight Encode calls get to finish on SIGTERM",
    )
    add(
        parser,
        "--stall-timeout-s",
        type=float,
        default=defaults.stall_timeout_s,
        help="report not ready while one vision forward has run this long, so the proxy routes around "
        "(0 = off; on a CPU one 12 MP photo takes about a minute)",
    )
    add(
        parser,
        "--liveness-timeout-s",
        type=float,
        default=defaults.liveness_timeout_s,
        help="report not alive (health service '') while one vision forward has run this long, so epd up or "
        "an orchestrator restarts the encoder; a dead worker thread turns it off for good (0 = that only)",
    )
    # The flag's old name, still accepted so existing deploy files keep working.
    parser.add_argument("--grace-s", dest="grace", type=float, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add(
        parser,
        "--fault",
        default="",
        help="TEST ONLY: inject hand-off faults, comma-separated: never-push (report success, push nothing), "
        "push-late-ms=N (wait N ms before each push), wrong-shape (push one row too few), "
        "wrong-dtype (push uint8), extra-chunk (send more bytes than declared); '' = none",
    )
    security.add_arguments(parser, grpc_server=True)
    security.add_metrics_arguments(parser)
    cli_args.group_flags(parser, HELP_GROUPS)


def config_from_args(args: argparse.Namespace) -> EncoderConfig:
    """The one place parsed flags become an ``EncoderConfig`` (ValueError if invalid)."""
    return EncoderConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        linear_backend=args.linear_backend,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        max_batch_images=args.max_batch_images,
        max_wait_ms=args.max_wait_ms,
        max_pending=args.max_pending,
        max_message_bytes=args.max_message_mib * MIB,
        cache_bytes=args.cache_mib * MIB,
        max_outbound_bytes=args.max_outbound_mib * MIB,
        push_chunk_bytes=args.push_chunk_kib * KIB,
        push_timeout_s=args.push_timeout_s,
        threads=args.threads,
        warmup=args.warmup,
        grace_s=args.grace,
        stall_timeout_s=args.stall_timeout_s,
        liveness_timeout_s=args.liveness_timeout_s,
        faults=Faults.parse(args.fault),
        security=security.from_args(args),
        pd_allow=PdAllowSpec.parse(args.pd_allow),
        accept_pixel_values=args.accept_pixel_values,
        max_video_frames=args.max_video_frames,
        max_video_seconds=args.max_video_seconds,
        max_video_bytes=args.max_video_bytes,
        video_threads=args.video_threads,
        video_queue=args.video_queue,
    )


async def serve(config: EncoderConfig, stop: asyncio.Event) -> None:
    """Starts the encoder, waits for ``stop``, then drains: NOT_SERVING -> ``stop(grace)``."""
    # Imported here so that ``--help`` does not pay for importing torch.
    from services.encoder.server import start_encoder

    server = await start_encoder(config)
    try:
        await stop.wait()
        log.info("encoder draining (grace %.1fs)", config.grace_s)
    finally:
        await server.stop(config.grace_s)
    log.info("encoder stopped")


def run(args: argparse.Namespace) -> int:
    """Runs the encoder until SIGTERM/SIGINT; returns the process exit code."""
    # Its idle OpenMP workers sleep: a spinning one takes a core from the PD beside it
    # (services/pd/shared_cores.py). Read when PyTorch loads, so before any import of it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from services.common.models.startup import refuse_unservable_model

    if (code := refuse_unservable_model(args.model, "epd encoder")) is not None:
        return code
    setup_logging(args.log_level, service="encoder", json_format=args.log_json)
    try:
        config = config_from_args(args)
    except ValueError as err:
        log.error("invalid encoder configuration: %s", err)
        return 2
    if config.threads > 0:
        import torch

        torch.set_num_threads(config.threads)
    host_memory.keep_freed_memory()  # the vision forward's activations stay mapped

    try:
        grpc_utils.run_until_signal(lambda stop: serve(config, stop))
    except Exception:
        log.exception("encoder failed")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m services.encoder.main``."""
    parser = argparse.ArgumentParser(prog="epd encoder", description="EPD vision encoder service")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

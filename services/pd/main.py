"""``epd pd``: run one PD (language model) instance.

The flags (``flags.py``) import nothing heavy (``--help`` stays fast); ``run``
imports the server, torch and transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.common import grpc_utils, openmp, security
from services.common.dial_allow import PdAllowSpec
from services.common.logs import setup_logging
from services.pd.config import PdConfig
from services.pd.faults import PdFaults
from services.pd.flags import add_arguments

__all__ = ["add_arguments", "config_from_args", "run"]

log = logging.getLogger(__name__)


def config_from_args(args: argparse.Namespace) -> PdConfig:
    return PdConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        threads=args.threads,
        linear_backend=args.linear_backend,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_mb=args.kv_cache_memory_mb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        slo_itl_ms=args.slo_itl_ms,
        slo_ttft_ms=args.slo_ttft_ms,
        min_prefill_tokens=args.min_prefill_tokens,
        image_hold_s=args.image_hold_s,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
        embedding_cache_tokens=args.embedding_cache_tokens,
        max_items_per_request=args.max_items_per_request,
        max_preallocations=args.max_preallocations,
        max_preallocations_per_peer=args.max_preallocations_per_peer,
        max_push_buffer_mb=args.max_push_buffer_mb,
        max_pushes_per_peer=args.max_pushes_per_peer,
        max_kv_push_buffer_mb=args.max_kv_push_buffer_mb,
        max_kv_reservation_share=args.max_kv_reservation_share,
        grammar_compile_timeout_s=args.grammar_compile_timeout_s,
        max_pending_grammar_compiles=args.max_pending_grammar_compiles,
        grammar_cache_mb=args.grammar_cache_mb,
        max_requests_per_peer=args.max_requests_per_peer,
        max_cache_subscribers=args.max_cache_subscribers,
        push_idle_timeout_s=args.push_idle_timeout_s,
        default_lease_ms=args.default_lease_ms,
        warmup=args.warmup,
        encoder=args.encoder,
        role=args.role,
        decode_allow=PdAllowSpec.parse(args.decode_allow, "--decode-allow"),
        accept_pixel_values=args.accept_pixel_values,
        max_video_frames=args.max_video_frames,
        max_video_seconds=args.max_video_seconds,
        max_video_bytes=args.max_video_bytes,
        grace_s=args.grace,
        stall_timeout_s=args.stall_timeout_s,
        liveness_timeout_s=args.liveness_timeout_s,
        faults=PdFaults.parse(args.fault),
        security=security.from_args(args),
    )


def run(args: argparse.Namespace) -> int:
    # Imported here, not for --help: the server imports torch and transformers.
    from services.common.models.startup import refuse_unservable_model
    from services.pd.runner.decode_plan import DecodePathRefused
    from services.pd.runner.kv_sizing import KvCacheTooSmall
    from services.pd.server import start_pd

    if (code := refuse_unservable_model(args.model, "epd pd")) is not None:
        return code
    setup_logging(args.log_level, service="pd", json_format=args.log_json)
    try:
        config = config_from_args(args)
    except ValueError as error:  # e.g. an unreadable --tls-cert: a usage error, not a crash
        log.error("invalid pd configuration: %s", error)
        return 2

    failed = False

    async def main(stop: asyncio.Event) -> None:
        nonlocal failed
        openmp.leave_teams_to_model_threads()  # the engine thread's team is the process's only one
        server = await start_pd(config)
        print(f"pd listening on {config.host}:{server.port}", flush=True)
        dead = asyncio.ensure_future(server.engine_dead.wait())
        await asyncio.wait([asyncio.ensure_future(stop.wait()), dead], return_when=asyncio.FIRST_COMPLETED)
        if dead.done():
            failed = True
            log.error("the engine thread died: exiting so that a supervisor can restart this PD")
            await server.stop(grace=0)
            return
        log.info("stopping: draining for up to %.0fs", config.grace_s)
        await server.stop()
        log.info("pd stopped")

    try:
        grpc_utils.run_until_signal(main)
    except (KvCacheTooSmall, DecodePathRefused) as error:  # problems the user fixes with a flag: no traceback
        log.error("pd cannot start: %s", error)
        return 2
    return 1 if failed else 0

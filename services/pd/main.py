"""``epd pd``: run one PD (language model) instance.

The flags import nothing heavy (``--help`` stays fast); ``run`` imports the
server, torch and transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from services.common import cli_args, grpc_utils, security
from services.common.dial_allow import PdAllowSpec
from services.common.logs import setup_logging
from services.common.ports import DEFAULT_PD_PORT
from services.common.video_files import VideoLimits
from services.pd.config import (
    DEFAULT_MAX_BUFFER_BYTES,
    DEFAULT_MAX_CACHE_SUBSCRIBERS,
    DEFAULT_MAX_KV_BUFFER_MB,
    DEFAULT_MAX_PUSHES_PER_PEER,
    DEFAULT_METRICS_PORT,
    PdConfig,
)
from services.pd.engine.kv_handoff import DEFAULT_MAX_SHARE_PER_PEER
from services.pd.engine.preallocated import DEFAULT_MAX_PREALLOCATED, DEFAULT_MAX_PREALLOCATED_PER_PEER
from services.pd.engine.step_budget import (
    AUTO_TARGET_MULTIPLE,
    AUTO_TTFT_MULTIPLE,
    DEFAULT_MIN_PREFILL_TOKENS,
    TYPICAL_PROMPT_TOKENS,
)
from services.pd.faults import PdFaults
from services.pd.runner.grammar_compile import DEFAULT_CACHE_MB, DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_MAX_PENDING_COMPILES

log = logging.getLogger(__name__)

HELP_GROUPS = (
    ("model and devices", ("--model", "--device", "--dtype", "--threads", "--linear-backend")),
    ("network", ("--host", "--port")),
    (
        "KV cache",
        (
            "--block-size",
            "--num-kv-blocks",
            "--kv-cache-memory-mb",
            "--gpu-memory-utilization",
            "--enforce-eager",
            "--enable-prefix-caching",
        ),
    ),
    (
        "scheduling",
        (
            "--max-num-batched-tokens",
            "--slo-itl-ms",
            "--slo-ttft-ms",
            "--min-prefill-tokens",
            "--max-num-seqs",
            "--max-model-len",
        ),
    ),
    (
        "limits",
        (
            "--max-waiting-requests",
            "--max-waiting-tokens",
            "--max-requests-per-peer",
            "--max-items-per-request",
            "--embedding-cache-tokens",
            "--default-lease-ms",
            "--max-preallocations",
            "--max-preallocations-per-peer",
            "--max-push-buffer-mb",
            "--max-pushes-per-peer",
            "--push-idle-timeout-s",
            "--max-kv-push-buffer-mb",
            "--max-kv-reservation-share",
            "--max-cache-subscribers",
        ),
    ),
    ("structured outputs", ("--grammar-compile-timeout-s", "--max-pending-grammar-compiles", "--grammar-cache-mb")),
    (
        "role and embeddings",
        (
            "--role",
            "--decode-allow",
            "--encoder",
            "--accept-pixel-values",
            "--max-video-frames",
            "--max-video-seconds",
            "--max-video-bytes",
        ),
    ),
    ("lifecycle", ("--warmup", "--grace", "--stall-timeout-s", "--liveness-timeout-s")),
    (
        "logging and metrics",
        ("--log-level", "--log-json", "--metrics-port", "--metrics-host", "--metrics-require-token"),
    ),
    ("testing", ("--fault",)),
)
"""``epd pd --help`` in groups."""


def parse_slo_ms(text: str) -> float | None:
    """``--slo-itl-ms`` / ``--slo-ttft-ms``: ``auto`` -> None, else milliseconds >= 0 (0 = off)."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected auto, 0 (off) or milliseconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError("expected auto, 0 (off) or a finite number of milliseconds >= 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the PD flags (each also read from ``EPD_<FLAG>``)."""
    cli_args.add_common_flags(parser, port=DEFAULT_PD_PORT, metrics_port=DEFAULT_METRICS_PORT)
    add = cli_args.add_flag
    add(parser, "--metrics-host", default="", help="address of the /metrics endpoint ('' = --host)")
    add(
        parser,
        "--linear-backend",
        default="auto",
        choices=["auto", "torch", "onednn"],
        help="who runs the LM's linear layers: torch, or oneDNN for float32 on CPU (about 2x faster there; "
        "batch rows are padded to buckets so its per-shape primitives stay bounded, see "
        "services/pd/runner/cpu_linear.py); auto = oneDNN for float32 on CPU when it works, else torch",
    )
    _add_cache_arguments(parser)
    _add_step_arguments(parser)
    _add_admission_arguments(parser)
    _add_lifecycle_arguments(parser)
    security.add_arguments(parser, grpc_server=True)
    security.add_metrics_arguments(parser)
    cli_args.group_flags(parser, HELP_GROUPS)


def _add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """KV cache size and layout, and how the device runs it."""
    add = cli_args.add_flag
    add(parser, "--block-size", type=int, default=16, help="tokens per KV cache block")
    add(
        parser,
        "--num-kv-blocks",
        type=int,
        default=0,
        help="KV cache blocks, taken as given (0 = size from memory: --kv-cache-memory-mb, or on CUDA "
        "--gpu-memory-utilization)",
    )
    add(
        parser,
        "--kv-cache-memory-mb",
        type=int,
        default=0,
        help="memory for the KV cache when --num-kv-blocks is 0 (0 = 1024 on CPU; on CUDA, what "
        "--gpu-memory-utilization leaves); start-up is refused when it cannot hold one --max-model-len request",
    )
    # GPU engine: services/pd/runner/kv_sizing.py, services/pd/runner/decode_plan.py
    add(
        parser,
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: share of the device's memory this PD may fill; after the weights and a profiling forward of "
        "--max-num-batched-tokens tokens, the KV cache gets the rest of that share (as in vLLM)",
    )
    add(
        parser,
        "--enforce-eager",
        default=False,
        help="CUDA: capture no CUDA graphs; decode-only steps run eagerly (graphs are captured at start-up for "
        "padded batch sizes 1, 2, 4, 8, then every 16 up to --max-num-seqs). Without it, a CUDA PD whose "
        "decode kernel compile or graph capture fails refuses to start; with it, nothing is captured and a "
        "kernel that fails to build only logs a warning (decode steps then take the packed path). The ready "
        "line's decode_paths= and epd_pd_captured_paths say what runs",
    )
    add(parser, "--enable-prefix-caching", default=True, help="reuse KV blocks of identical prompt prefixes")


def _add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """What one engine step may hold: its token cap, the prefill share, the running batch."""
    add = cli_args.add_flag
    add(
        parser,
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one engine step: a hard cap (the SLO targets may give prefill less of it)",
    )
    _add_slo_arguments(parser)
    add(
        parser,
        "--min-prefill-tokens",
        type=int,
        default=DEFAULT_MIN_PREFILL_TOKENS,
        help="prefill tokens every step may take whatever --slo-itl-ms says, so a waiting prompt advances "
        "under any decode load (its time to first token stays bounded); the price: a step may exceed the "
        "target by the time of this many tokens. Larger = faster first tokens under load, spikier "
        "inter-token latency",
    )
    add(parser, "--max-num-seqs", type=int, default=64, help="most requests running at once")
    add(parser, "--max-model-len", type=int, default=0, help="context length (0 = the model's)")


def _add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    """The two latency targets each step's prefill share is sized for (services/pd/engine/step_budget.py)."""
    # --target-itl-ms (and EPD_TARGET_ITL_MS) is kept as an alias of --slo-itl-ms for existing deployments.
    legacy = os.environ.get("EPD_TARGET_ITL_MS")
    itl_default = os.environ.get("EPD_SLO_ITL_MS", legacy if legacy is not None else "auto")
    parser.add_argument(
        "--slo-itl-ms",
        "--target-itl-ms",
        dest="slo_itl_ms",
        type=parse_slo_ms,
        default=parse_slo_ms(itl_default),
        help="inter-token latency PD keeps for decoding streams: while anything decodes, each step's prefill "
        "chunk is sized from an online model of step time (fitted to the steps PD runs, seeded by the warm-up) "
        "so that the step, plus engine-thread work since the last one (colocated: the vision forward), stays "
        "within it, unless waiting prompts need more (see --slo-ttft-ms); with nothing decoding prefill gets "
        f"the whole --max-num-batched-tokens. auto = {AUTO_TARGET_MULTIPLE:g}x the predicted decode-only step "
        "at the current batch; a number = that many ms; 0 = off: every step may prefill up to "
        "--max-num-batched-tokens whatever decodes. --target-itl-ms is an alias kept for older deployments "
        "[env EPD_SLO_ITL_MS, or EPD_TARGET_ITL_MS; default: auto]",
    )
    cli_args.add_flag(
        parser,
        "--slo-ttft-ms",
        type=parse_slo_ms,
        default="auto",
        help="time to first token PD aims at for each prompt, counted from its arrival at PD less the time it "
        "waited for its images: a prompt whose deadline approaches gets the prefill it needs even if that "
        "step exceeds --slo-itl-ms (a prompt that can no longer make it does not); several waiting prompts "
        f"get one ITL share each. auto = {AUTO_TTFT_MULTIPLE:g}x the predicted lone prefill of the prompt, "
        f"at least of a {TYPICAL_PROMPT_TOKENS}-token prompt (predictions seeded by the warm-up's measured "
        "steps); a number = that many ms for every prompt; 0 = off (no deadline share)",
    )


def _add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """Limits on what PD accepts before any work: queues, images, reservations."""
    add = cli_args.add_flag
    add(parser, "--max-waiting-requests", type=int, default=1024, help="queued requests before Generate is refused")
    add(
        parser,
        "--max-waiting-tokens",
        type=int,
        default=262144,
        help="prompt tokens of all queued requests before Generate is refused",
    )
    add(
        parser,
        "--embedding-cache-tokens",
        type=int,
        default=65536,
        help="image embedding cache capacity, in tokens (rows; a Qwen3-VL row also holds its DeepStack features)",
    )
    add(parser, "--default-lease-ms", type=int, default=30_000, help="how long a reservation waits for its push")
    add(
        parser,
        "--max-items-per-request",
        type=int,
        default=64,
        help="most images one Preallocate or Generate may carry (more: INVALID_ARGUMENT)",
    )
    add(
        parser,
        "--max-preallocations",
        type=int,
        default=DEFAULT_MAX_PREALLOCATED,
        help="requests that may hold room from a Preallocate (pinned KV, image reservations) before their "
        "Generate, in total; more: RESOURCE_EXHAUSTED with a retry hint",
    )
    add(
        parser,
        "--max-preallocations-per-peer",
        type=int,
        default=DEFAULT_MAX_PREALLOCATED_PER_PEER,
        help="the same bound per caller address, so that one caller cannot take all of it",
    )
    add(
        parser,
        "--max-requests-per-peer",
        type=int,
        default=0,
        help="Generate calls in progress (waiting or running) per caller address; the next is RESOURCE_EXHAUSTED "
        "with a retry hint, so that with several proxies one cannot take the whole queue (0 = off: the waiting "
        "queue's own bounds only, right for one proxy)",
    )
    add(
        parser,
        "--max-cache-subscribers",
        type=int,
        default=DEFAULT_MAX_CACHE_SUBSCRIBERS,
        help="SubscribeCacheEvents streams open at once (the proxies' cache-aware routing follows this PD's "
        "caches on one each); more: RESOURCE_EXHAUSTED",
    )
    add(
        parser,
        "--max-push-buffer-mb",
        type=int,
        default=DEFAULT_MAX_BUFFER_BYTES >> 20,
        help="payload buffers of all embedding pushes in flight together, MiB (each holds its embedding's full size "
        "until it lands); a push beyond it: RESOURCE_EXHAUSTED with a retry hint, its reservation stays open",
    )
    add(
        parser,
        "--max-pushes-per-peer",
        type=int,
        default=DEFAULT_MAX_PUSHES_PER_PEER,
        help="embedding pushes in flight from one caller address, and KV pushes (PushKV) apart from them",
    )
    add(
        parser,
        "--push-idle-timeout-s",
        type=float,
        default=10.0,
        help="a PushEmbedding or PushKV stream that sends no bytes for this long is ended (DEADLINE_EXCEEDED); "
        "empty chunks do not count",
    )
    add(
        parser,
        "--max-kv-push-buffer-mb",
        type=int,
        default=DEFAULT_MAX_KV_BUFFER_MB,
        help="with --role decode|both: payload buffers of all KV pushes being received together, MiB (each holds "
        "its reservation's full size until it lands; one larger push is let in alone); a push beyond it: "
        "RESOURCE_EXHAUSTED with a retry hint, its reservation stays open",
    )
    add(
        parser,
        "--max-kv-reservation-share",
        type=float,
        default=DEFAULT_MAX_SHARE_PER_PEER,
        help="with --role decode|both: the share of the decode slots (--max-num-seqs; at least one) and of the KV "
        "blocks that the live ReserveKV reservations of one caller address may hold (its only reservation may "
        "take more blocks); more: RESOURCE_EXHAUSTED with a retry hint",
    )
    add(
        parser,
        "--grammar-compile-timeout-s",
        type=float,
        default=DEFAULT_COMPILE_TIMEOUT_S,
        help="structured outputs: the longest one constraint (JSON schema, regex, grammar, choice) may take to "
        "compile; each is compiled first in a child process that is killed past it, and the request is refused "
        "with INVALID_ARGUMENT (400), as is the same constraint again",
    )
    add(
        parser,
        "--max-pending-grammar-compiles",
        type=int,
        default=DEFAULT_MAX_PENDING_COMPILES,
        help="structured outputs: constraints waiting for a compile or in one (one at a time; a cached one "
        "never waits); more: RESOURCE_EXHAUSTED with a retry hint",
    )
    add(
        parser,
        "--grammar-cache-mb",
        type=int,
        default=DEFAULT_CACHE_MB,
        help="structured outputs: MiB the compiled grammars kept for reuse may hold (xgrammar's estimate of "
        "each, plus its constraint's text), least recently used out first; a larger one is used by its "
        "request and not kept",
    )


def _add_lifecycle_arguments(parser: argparse.ArgumentParser) -> None:
    """Start-up, where embeddings come from, shutdown, probes and test-only faults."""
    add = cli_args.add_flag
    add(parser, "--warmup", default=True, help="generate one token before reporting ready")
    add(
        parser,
        "--accept-pixel-values",
        default=False,
        help="with --encoder local: also take processed pixel tensors in Encode calls (older proxies); their "
        "mm_hash cannot be checked against the image, so any caller with the token could plant an embedding",
    )
    video = VideoLimits()  # the proxy's and the encoder's defaults
    add(
        parser,
        "--max-video-frames",
        type=int,
        default=video.max_frames,
        help="with --encoder local: most frames sampled of one video (keep it equal to the proxy's)",
    )
    add(
        parser,
        "--max-video-seconds",
        type=float,
        default=video.max_seconds,
        help="with --encoder local: longest video (keep it equal to the proxy's)",
    )
    add(
        parser,
        "--max-video-bytes",
        type=int,
        default=video.max_bytes,
        help="with --encoder local: largest video file (keep it equal to the proxy's)",
    )
    add(
        parser,
        "--role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="both = prefill and decode here (default); prefill = prefill and sample the first token, then "
        "push the KV to the decode instance its Generate names; decode = decode requests whose KV a "
        "prefill instance pushed into a ReserveKV reservation",
    )
    add(
        parser,
        "--decode-allow",
        default="",
        help="with --role prefill|both: the decode PDs a hand-off may name, which alone this PD dials (with the "
        "internal token): comma-separated host:port entries; a host name also allows every address it resolves "
        "to on that port; '*' = any address; '' = loopback addresses only. Others: PERMISSION_DENIED",
    )
    add(
        parser,
        "--encoder",
        default="remote",
        choices=["remote", "local"],
        help="where image embeddings come from: remote = encoder services push them; local = colocated "
        "baseline: this PD loads the vision tower, serves epd.v1.Encoder on its own port and encodes "
        "inside its step loop (blocking the batch like a monolithic engine)",
    )
    add(parser, "--grace", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM")
    add(
        parser,
        "--stall-timeout-s",
        type=float,
        default=60.0,
        help="report not ready while the step loop is stuck this long with work pending (0 = off)",
    )
    add(
        parser,
        "--liveness-timeout-s",
        type=float,
        default=300.0,
        help="report not alive (health service '') once the step loop is stuck this long; a dead engine "
        "thread is never alive and makes the process exit (0 = only a dead thread counts)",
    )
    add(
        parser,
        "--fault",
        default="",
        help="TEST ONLY: inject step-loop faults, comma-separated, each once, steps counted after warm-up: "
        "forward-raises-after=N (the forward of step N raises), freeze-step-ms=M (a step stalls M ms), "
        "freeze-after=N (which step stalls; default 0), drop-deepstack (zero the DeepStack features of every "
        "embedding received: a Qwen3-VL answer then differs); '' = none",
    )


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

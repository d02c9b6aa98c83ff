"""``epd pd``'s flags, and how ``--help`` groups them (``HELP_GROUPS``).

Every flag of ``epd pd`` is defined here (model and devices, KV cache, step
budget, lifecycle) or, for the limits on what PD accepts, in
``limit_flags.py``. They import nothing heavy, so ``--help`` stays fast;
``main.py`` turns the parsed flags into a ``PdConfig`` and runs the server.
"""

from __future__ import annotations

import argparse
import os

from services.common import cli_args, security
from services.common.ports import DEFAULT_PD_PORT
from services.common.video_files import VideoLimits
from services.pd.config import DEFAULT_METRICS_PORT
from services.pd.engine.step_budget import (
    AUTO_TARGET_MULTIPLE,
    AUTO_TTFT_MULTIPLE,
    DEFAULT_MIN_PREFILL_TOKENS,
    HEAD_STEP_MULTIPLE,
    TYPICAL_PROMPT_TOKENS,
)
from services.pd.limit_flags import add_limit_arguments
from services.pd.shared_cores import MAX_HOLD_PERIOD_S

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
            "--image-hold-s",
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
        choices=["auto", "torch", "onednn", "kernel"],
        help="who runs the LM's linear layers on CPU for float32: kernel (a C kernel over weights packed at "
        "start, built with the C compiler; fastest at decode batch sizes), onednn (about 2x torch), or torch "
        "(services/common/cpu_linear.py); auto = kernel where it builds, else onednn where it works, else "
        "torch; torch on GPUs and for other dtypes",
    )
    _add_cache_arguments(parser)
    _add_step_arguments(parser)
    add_limit_arguments(parser)
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
    add(
        parser,
        "--image-hold-s",
        type=float,
        default=MAX_HOLD_PERIOD_S,
        help="a CPU PD with an encoder beside it (not colocated) holds its steps while an image it awaits is "
        "encoded, until the image arrives, for at most this many seconds of a stretch of awaiting: the "
        "encoder computes alone and the prompts whose images came are prefilled together; a step with a "
        "text-only prompt is never held. 0 = never hold (a PD whose encoders run on other machines)",
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
        "within it, unless waiting prompts need more: the prompt first in line may take a step of up to "
        f"{HEAD_STEP_MULTIPLE:g} targets, so it starts in one step; see also --slo-ttft-ms. With nothing "
        "decoding prefill gets the whole --max-num-batched-tokens. "
        f"auto = {AUTO_TARGET_MULTIPLE:g}x the predicted decode-only step at the current batch; "
        "a number = that many ms; 0 = off: every step may prefill up to "
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
        "step exceeds --slo-itl-ms (a prompt that can no longer make it does not); beside the prompt first "
        "in line, several waiting prompts get one ITL share each. "
        f"auto = {AUTO_TTFT_MULTIPLE:g}x the predicted lone prefill of the prompt, at least of a "
        f"{TYPICAL_PROMPT_TOKENS}-token prompt (predictions seeded by the warm-up's measured steps); "
        "a number = that many ms for every prompt; 0 = off (no deadline share)",
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

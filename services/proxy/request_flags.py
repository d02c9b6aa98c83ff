"""``epd proxy``'s flags on requests: what one may carry and what the proxy spends on it.

Size limits (messages, images, videos, tokens, choices, unknown fields), the
preprocessing pools, and what each client may hold (quotas, cache sharing).
Part of the flags of ``epd proxy`` (``flags.py`` adds these and groups them
for ``--help``); like them, nothing heavy is imported.
"""

from __future__ import annotations

import argparse

from services.common import cli_args
from services.proxy.cache_isolation import CacheIsolation
from services.proxy.config import ProxyConfig


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """Limits of one request, its reservations' lease, the preprocessing pools and per-client bounds."""
    add = cli_args.add_flag
    defaults = ProxyConfig()
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

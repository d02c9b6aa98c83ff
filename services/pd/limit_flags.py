"""``epd pd``'s limits on what PD accepts before any work: queues, images, reservations, pushes, grammars.

Part of the flags of ``epd pd`` (``flags.py`` adds these and groups them for
``--help``); like them, nothing heavy is imported.
"""

from __future__ import annotations

import argparse

from services.common import cli_args
from services.pd.config import (
    DEFAULT_MAX_BUFFER_BYTES,
    DEFAULT_MAX_CACHE_SUBSCRIBERS,
    DEFAULT_MAX_KV_BUFFER_MB,
    DEFAULT_MAX_PUSHES_PER_PEER,
)
from services.pd.engine.kv_handoff import DEFAULT_MAX_SHARE_PER_PEER
from services.pd.engine.preallocated import DEFAULT_MAX_PREALLOCATED, DEFAULT_MAX_PREALLOCATED_PER_PEER
from services.pd.runner.grammar_compile import DEFAULT_CACHE_MB, DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_MAX_PENDING_COMPILES


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
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

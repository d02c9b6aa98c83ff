"""Prefix-cache block keys: PD's cache keys them so, and the proxy computes the same keys to route on them.

A prompt is cut into blocks of ``block_size`` tokens; full block ``i`` is keyed
``H(key of block i-1, its token ids, the images overlapping it)``, a chain, so a
key names the whole prefix up to the block's end. Image placeholder tokens are
identical for every image, so the key also carries the ``mm_hash`` of each
overlapping image, where it starts relative to the block and, for models with
multimodal RoPE, its grid (which decides the positions its tokens and every
later token rotate by). The first block's chain starts from the request's cache
salt (``""`` for none), so two tenants' identical prompts never share a key.

PD's ``KVCacheManager`` keys its blocks with ``extend_block_keys``, and its
cache-event stream names blocks by these keys; the proxy's cache-aware routing
hashes a prompt the same way to find how much of it each PD holds. One
function for both, so the two can never disagree. Pure Python (hashlib).
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import Protocol

KEY_BYTES = 32
"""Length of a block key (SHA-256)."""


class KeySpan(Protocol):
    """An image in a prompt as its keys see it (PD's ``MultiModalSpan`` is one)."""

    @property
    def mm_hash(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def grid(self) -> tuple[int, int, int] | None: ...
    @property
    def frame_offsets(self) -> tuple[int, ...]: ...


def block_key(prev_key: bytes, token_ids: Sequence[int], extras: Sequence[str] = ()) -> bytes:
    """Chained, collision-resistant key of one full block.

    ``extras`` name what else decides the block's K/V (images overlapping it).
    Token ids are fixed-width, so the byte stream is unambiguous.
    """
    digest = hashlib.sha256(prev_key)
    digest.update(array("q", token_ids).tobytes())
    for extra in extras:
        digest.update(extra.encode())
        digest.update(b"\x00")
    return digest.digest()


def extend_block_keys(
    keys: list[bytes],
    num_blocks: int,
    block_size: int,
    tokens: Callable[[int, int], Sequence[int]],
    spans: Sequence[KeySpan],
    cache_salt: str = "",
    private_salt: bytes = b"",
    private_from: int = 0,
) -> list[bytes]:
    """Appends to ``keys`` (the keys of the first ``len(keys)`` blocks) those of blocks up to ``num_blocks``.

    ``tokens(start, end)`` gives the token ids of positions ``[start, end)``;
    ``spans`` are the prompt's images, sorted and disjoint. One pass over the
    blocks and the spans together: linear in blocks + images. Returns ``keys``.
    ``private_salt`` (PD only: K/V that arrived by push) forks the chain at
    block ``private_from``, so no other request's keys match from there on.
    """
    if len(keys) >= num_blocks:
        return keys
    ends = [span.offset + span.num_tokens for span in spans]
    first = bisect.bisect_right(ends, len(keys) * block_size)  # first span ending after the known blocks
    for i in range(len(keys), num_blocks):
        start, end = i * block_size, (i + 1) * block_size
        while first < len(spans) and ends[first] <= start:
            first += 1
        extras, j = [], first
        while j < len(spans) and spans[j].offset < end:  # ``mm_hash@offset[/(t, h, w)]``, offset relative to the block
            span = spans[j]
            grid = None if span.grid is None else tuple(span.grid)  # M-RoPE: the grid decides the tokens' positions
            frames = span.frame_offsets  # where a video's runs are (Qwen3-VL), relative to its offset
            extras.append(
                f"{span.mm_hash}@{span.offset - start}"
                + (f"/{grid}" if grid else "")
                + (f"+{[f - span.offset for f in frames]}" if frames else "")
            )
            j += 1
        # The first block's key is seeded by the tenant's salt (vLLM's cache_salt): the chain carries it on.
        prev = keys[-1] if keys else cache_salt.encode()
        if private_salt and i == private_from:
            prev = hashlib.sha256(prev + private_salt).digest()  # this request's own from here
        keys.append(block_key(prev, tokens(start, end), extras))
    return keys


def prompt_block_keys(
    token_ids: Sequence[int], spans: Sequence[KeySpan], block_size: int, cache_salt: str = ""
) -> list[bytes]:
    """Keys of a prompt's blocks that a prefix-cache hit can cover: every full block but the one holding
    the last token (PD always computes that token, to sample from it)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    num_blocks = max(0, (len(token_ids) - 1) // block_size)
    return extend_block_keys([], num_blocks, block_size, lambda start, end: token_ids[start:end], spans, cache_salt)

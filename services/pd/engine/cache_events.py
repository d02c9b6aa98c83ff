"""What PD's two caches gained and lost, for the proxies' cache-aware routing. Pure Python.

The KV cache reports each block key it registers (``stored``) or evicts
(``removed``); the embedding cache each ``mm_hash`` that becomes READY or is
evicted. Keys are the ones the caches use (``services/common/prefix_keys.py``
for blocks, images included). The recorder nets the changes between two
``take`` calls: a key's last change wins, so a batch names each key once and
the order inside a batch does not matter. The service shell (``cache_feed.py``)
takes one batch per engine-loop iteration, numbers it and streams it.

Recording is off until the first subscriber asks for a snapshot
(``enable``): a PD nobody routes by cache pays nothing.

Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheChanges:
    """One batch of net changes (each key at most once)."""

    blocks_stored: tuple[bytes, ...] = ()  # prefix-cache keys now cached
    blocks_removed: tuple[bytes, ...] = ()  # keys evicted (or reset)
    embeddings_stored: tuple[tuple[str, int], ...] = ()  # (mm_hash, rows) of embeddings now READY
    embeddings_removed: tuple[str, ...] = ()  # mm_hash of evicted embeddings

    @property
    def num_changes(self) -> int:
        return (
            len(self.blocks_stored)
            + len(self.blocks_removed)
            + len(self.embeddings_stored)
            + len(self.embeddings_removed)
        )


class CacheEventRecorder:
    """Collects the caches' changes between ``take`` calls (see the module docstring)."""

    def __init__(self) -> None:
        self.enabled = False
        self._blocks: dict[bytes, bool] = {}  # key -> cached after the last change
        self._embeddings: dict[str, int] = {}  # mm_hash -> rows when READY, 0 when removed

    def enable(self) -> None:
        """Start recording (idempotent). Changes before this were never recorded: a snapshot covers them."""
        self.enabled = True

    def block_stored(self, key: bytes) -> None:
        if self.enabled:
            self._blocks[key] = True

    def block_removed(self, key: bytes) -> None:
        if self.enabled:
            self._blocks[key] = False

    def embedding_stored(self, mm_hash: str, num_tokens: int) -> None:
        if self.enabled:
            self._embeddings[mm_hash] = num_tokens

    def embedding_removed(self, mm_hash: str) -> None:
        if self.enabled:
            self._embeddings[mm_hash] = 0

    def take(self) -> CacheChanges | None:
        """The net changes since the last call, or None when there are none."""
        if not self._blocks and not self._embeddings:
            return None
        blocks, embeddings = self._blocks, self._embeddings
        self._blocks, self._embeddings = {}, {}
        return CacheChanges(
            blocks_stored=tuple(k for k, cached in blocks.items() if cached),
            blocks_removed=tuple(k for k, cached in blocks.items() if not cached),
            embeddings_stored=tuple((h, n) for h, n in embeddings.items() if n),
            embeddings_removed=tuple(h for h, n in embeddings.items() if not n),
        )


@dataclass(frozen=True)
class CacheSnapshot:
    """Everything both caches hold at one moment: what a new subscriber starts from."""

    block_size: int  # tokens per KV block: the proxy keys prompts with it
    block_keys: tuple[bytes, ...]  # every prefix-cache key, oldest registration first
    embeddings: tuple[tuple[str, int], ...]  # (mm_hash, rows) of every READY embedding

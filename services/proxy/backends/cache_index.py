"""What each PD's caches hold, built from its cache-event stream: the cache-aware policy's view.

Every PD streams the keys of the prefix-cache blocks it stores and evicts
and the ``mm_hash`` of the image embeddings it stores and evicts
(``SubscribeCacheEvents``, ``services/pd/cache_feed.py``): a snapshot, then
numbered batches. ``CacheIndex`` keeps, per PD address, the set of what it
holds, from those events only (never from what the proxy merely sent it).
A stream starts the PD's entry afresh (``begin``); a batch out of sequence or
from another instance id (a restarted PD) is refused (``apply`` returns
False) and the follower resubscribes; a PD whose stream ends, or that leaves
the pool, is dropped (``drop``): a dead PD's entries go with its stream.

Memory is bounded: at most ``max_entries`` keys and hashes over all PDs
(``max_bytes // ENTRY_BYTES``), shared evenly by the PDs being followed.
Each PD's entries are an ``OrderedDict`` in recency order (stored, or matched by a
lookup, moves an entry to the end); past its share the oldest go. An entry
dropped here only makes routing less informed: the PD still has the block.

A prompt (``RoutedPrompt``) is hashed with ``services/common/prefix_keys.py``,
the function PD keys its cache with, once per block size.

Lives on the proxy's event loop; nothing here blocks or locks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.pb import epd_pb2
from services.common.prefix_keys import prompt_block_keys

ENTRY_BYTES = 256
"""Memory of one entry, estimated high: a 32-byte key (a 65-byte ``bytes``) or a 64-character ``mm_hash``
(113 bytes) and its ``OrderedDict`` slot and node (measured: 150-200 bytes in all;
``tests/unit/proxy/test_proxy_cache_index.py`` checks the bound with tracemalloc)."""
DEFAULT_MAX_BYTES = 64 << 20
"""``--pd-cache-index-mb``'s default: 262,144 entries over all PDs (4.2 M tokens at 16 per block)."""


@dataclass(frozen=True)
class PromptImage:
    """An image of a routed prompt, as its block keys see it (``prefix_keys.KeySpan``)."""

    mm_hash: str
    offset: int
    num_tokens: int
    grid: tuple[int, int, int] | None = None
    frame_offsets: tuple[int, ...] = ()  # a video's runs, when text separates its frames (Qwen3-VL)


@dataclass(frozen=True)
class RouteDecision:
    """Why the cache-aware policy put a request first on ``address`` (metrics and the access log)."""

    address: str
    reason: str  # "cache": longest cached prefix; "load": no PD held more; "load_over_cache": load outweighed it
    hit_tokens: int  # prompt tokens the chosen PD holds (prefix, plus images past it held as embeddings)
    best_hit_tokens: int  # the most any candidate held
    load_tokens: int  # the chosen PD's load estimate


@dataclass
class RoutedPrompt:
    """What routing sees of one request: token ids, images and cache salt; its keys are computed on demand.

    ``decision`` is set by the cache-aware policy when it ranks PDs for this prompt.
    """

    token_ids: Sequence[int]
    images: tuple[PromptImage, ...] = ()
    cache_salt: str = ""
    decision: RouteDecision | None = None
    _keys: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def keys(self, block_size: int) -> list[bytes]:
        """The keys of the prompt's blocks that a PD with ``block_size`` could hold (memoised)."""
        keys = self._keys.get(block_size)
        if keys is None:
            keys = self._keys[block_size] = prompt_block_keys(self.token_ids, self.images, block_size, self.cache_salt)
        return keys


@dataclass(frozen=True)
class CacheHit:
    """How much of a prompt one PD holds, in prompt tokens."""

    prefix_tokens: int = 0  # the longest run of its blocks, from the first, in the PD's prefix cache
    embedding_tokens: int = 0  # tokens of images past that run whose embeddings the PD holds (no encode)

    @property
    def tokens(self) -> int:
        return self.prefix_tokens + self.embedding_tokens


@dataclass
class _PdEntries:
    """One PD's stream state and what it holds (block keys are ``bytes``, image hashes ``str``: never equal)."""

    instance_id: str = ""
    block_size: int = 0
    sequence: int = -1  # the last applied message's (-1: nothing yet)
    snapshot_done: bool = False
    entries: OrderedDict[bytes | str, None] = field(default_factory=OrderedDict)  # least recent first


class CacheIndex:
    """PD address -> the block keys and image hashes its caches hold (see the module docstring)."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        on_lag: Callable[[float], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``on_lag`` hears each change batch's age on arrival (seconds, PD's wall clock to ours)."""
        if max_bytes < ENTRY_BYTES:
            raise ValueError(f"max_bytes must be at least {ENTRY_BYTES}")
        self.max_entries = max_bytes // ENTRY_BYTES
        self._pds: dict[str, _PdEntries] = {}
        self._on_lag = on_lag
        self._wall_clock = wall_clock

    # -- queries ----------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return sum(len(pd.entries) for pd in self._pds.values())

    @property
    def num_bytes(self) -> int:
        """The memory estimate the bound is kept in (``ENTRY_BYTES`` per entry)."""
        return self.num_entries * ENTRY_BYTES

    def sizes(self) -> dict[str, int]:
        """Entries per followed PD address."""
        return {address: len(pd.entries) for address, pd in self._pds.items()}

    def instance_id(self, address: str) -> str | None:
        pd = self._pds.get(address)
        return None if pd is None else pd.instance_id

    def hit(self, address: str, prompt: RoutedPrompt) -> CacheHit:
        """How much of ``prompt`` the PD at ``address`` holds (nothing when it is not followed).

        Whole blocks from the first, up to the first missing key (PD's own lookup rule), never the block
        holding the last token; then the images not inside that run whose embedding it holds. What
        matched becomes most recently used.
        """
        pd = self._pds.get(address)
        if pd is None or not pd.block_size:
            return CacheHit()
        entries = pd.entries
        keys = prompt.keys(pd.block_size)
        num_blocks = 0
        for key in keys:
            if key not in entries:
                break
            num_blocks += 1
        prefix_tokens = num_blocks * pd.block_size
        held = [i.mm_hash for i in prompt.images if i.offset + i.num_tokens > prefix_tokens and i.mm_hash in entries]
        matched: list[bytes | str] = [*keys[:num_blocks], *held]
        for entry in matched:
            entries.move_to_end(entry)
        embedding_tokens = sum(i.num_tokens for i in prompt.images if i.mm_hash in held)
        return CacheHit(prefix_tokens, embedding_tokens)

    # -- the stream ---------------------------------------------------------------
    def begin(self, address: str) -> None:
        """A new stream from ``address``: whatever was known of it is forgotten until its snapshot arrives."""
        self._pds[address] = _PdEntries()
        self._trim_all()

    def apply(self, address: str, message: epd_pb2.CacheEvents) -> bool:
        """Applies one message of ``address``'s stream; False (nothing applied) when it is out of order
        (a gap in sequence numbers, another instance id, a snapshot after changes): resubscribe."""
        pd = self._pds.get(address)
        if pd is None:
            return False
        if message.snapshot:
            if pd.snapshot_done or (pd.sequence >= 0 and message.sequence != pd.sequence):
                return False
            if pd.sequence >= 0 and message.instance_id != pd.instance_id:
                return False
            pd.instance_id, pd.block_size, pd.sequence = message.instance_id, message.block_size, message.sequence
        else:
            if pd.sequence < 0 or message.sequence != pd.sequence + 1 or message.instance_id != pd.instance_id:
                return False
            pd.snapshot_done, pd.sequence = True, message.sequence
            if message.unix_time_ms and self._on_lag is not None:
                self._on_lag(max(0.0, self._wall_clock() - message.unix_time_ms / 1000.0))
        entries = pd.entries
        for key in message.blocks_removed:
            entries.pop(key, None)
        for mm_hash in message.embeddings_removed:
            entries.pop(mm_hash, None)
        stored: list[bytes | str] = [*message.blocks_stored, *(e.mm_hash for e in message.embeddings_stored)]
        for entry in stored:
            entries[entry] = None
            entries.move_to_end(entry)  # re-stored: most recent
        self._trim(pd)
        return True

    def drop(self, address: str) -> None:
        """Forgets ``address`` (its stream ended, or it left the pool). Idempotent."""
        if self._pds.pop(address, None) is not None:
            self._trim_all()  # not needed for the bound; keeps shares even

    # -- the bound ----------------------------------------------------------------
    def _share(self) -> int:
        return max(1, self.max_entries // max(1, len(self._pds)))

    def _trim(self, pd: _PdEntries) -> None:
        entries, share = pd.entries, self._share()
        while len(entries) > share:
            entries.popitem(last=False)  # the least recently stored or matched

    def _trim_all(self) -> None:
        for pd in self._pds.values():
            self._trim(pd)

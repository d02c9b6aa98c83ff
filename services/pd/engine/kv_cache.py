"""Paged KV-cache bookkeeping with prefix caching. Pure Python: block ids only.

Blocks ``0 .. num_blocks - 1`` index the runner's KV tensors. A request owns an
ordered block table (``request.block_ids``); block ``i`` holds the K/V of token
positions ``[i * block_size, (i + 1) * block_size)``.

Prefix caching: once a block is full and computed, it is registered under a
chained key ``H(previous key, token ids, images overlapping the block)``
(``services/common/prefix_keys.py``, shared with the proxy's routing). Image
placeholder tokens are identical for every image, so the key also carries the
``mm_hash`` of each overlapping image, where the image starts relative to the
block and, for models with multimodal RoPE, the image's grid (it decides the
positions its tokens and every later token rotate by): two different images,
or one image claimed with two grids, at the same position never share KV.
The first block's chain starts from the request's cache salt (``""`` for
none), so two tenants' identical prompts never share a block either. K/V
that arrived over the wire (a KV hand-off's decode side) is keyed from its
first pushed block on under a random salt of its request's own
(``Request.private_kv_salt``): only that request, re-admitted after a
preemption, finds it again.

Freed blocks keep their key and join an LRU free queue, so a later request with
the same prefix can revive them; a block is evicted from the key map only when
it is handed out again. Blocks that never held a full cached block are reused
first (they cost nothing to lose).

Placement: a request's next block is the one right after its last block when
that one is free and blank, and the blank blocks it is expected to grow into
go to the back of the free queue; tables then tend to be contiguous, which
lets decode attention read them in place.

Pins: an owner can hold references on cached blocks (``pin`` / ``unpin``),
so they cannot be evicted. Preallocate uses this when it answers READY for
an image whose KV is already cached (the blocks stay until the request ends,
or its lease does), and a request whose images are computed pins the blocks
through them in place of its image embeddings (``pin_computed_prefix``): a
preemption frees the rest of its table, and re-admission claims the pinned
blocks as its prefix.

Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from services.common.prefix_keys import extend_block_keys
from services.pd.engine.cache_events import CacheEventRecorder
from services.pd.engine.invariants import check
from services.pd.engine.request import CachedPrefix, Request
from services.pd.engine.spans import token_slice

# Most blank blocks kept ahead of one request: a max_tokens in the thousands
# must not push the whole blank pool behind the prefix cache.
_MAX_KEPT_ROOM_BLOCKS = 64


class KVCacheManager:
    """Allocates fixed-size KV blocks to requests, with ref counts and prefix reuse.

    Invariants (``check_integrity``): every block is either in the free queue
    with ref count 0 or in use with ref count > 0; a block in the key map
    carries that key.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: CacheEventRecorder | None = None,
    ):
        """``events`` hears of every key registered or evicted (the proxies' cache-aware routing)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[bytes | None] = [None] * num_blocks
        self._key_to_block: dict[bytes, int] = {}
        # Front = next to hand out. Holds exactly the blocks with ref count 0.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # request_id -> number of leading blocks already registered in the key map.
        self._num_registered: dict[str, int] = {}
        self._pins: dict[str, list[int]] = {}  # owner -> pinned block ids
        self.events = events or CacheEventRecorder()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including evictable cached ones)."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (0.0 .. 1.0)."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently reachable through the prefix-cache key map."""
        return len(self._key_to_block)

    @property
    def num_pinned_blocks(self) -> int:
        """Block references held by pins (a block pinned twice counts twice)."""
        return sum(len(ids) for ids in self._pins.values())

    def cached_keys(self) -> list[bytes]:
        """Every key in the prefix cache, oldest registration first (a cache-event snapshot)."""
        return list(self._key_to_block)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of ``request`` as ``(block_ids, num_tokens)``.

        Only whole blocks hit, and never the block holding the last known token:
        that token must be computed so the runner can sample from it. Changes no
        ref count; pass the ids to ``allocate_slots`` to take them.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        keys = self._block_keys_of(request, max_blocks)
        hit_ids: list[int] = []
        for key in keys:
            block_id = self._key_to_block.get(key)
            if block_id is None:
                break
            hit_ids.append(block_id)
        return hit_ids, len(hit_ids) * self.block_size

    # --------------------------------------------------------------- mutations
    def claim_cached_prefix(self, request: Request) -> CachedPrefix:
        """The request's cached prefix, kept on it (``request.cached_prefix``) until admission.

        The one place a request's cached prefix is computed: the first call
        looks it up; later calls only re-check it, cutting it at the first
        block reused since (a block its owner pinned is never reused).
        Admission hands the blocks to the block table and clears it; a
        preempted request then looks again.
        """
        prefix = request.cached_prefix
        if prefix is None:
            block_ids, num_tokens = self.get_computed_blocks(request)
            prefix = CachedPrefix(tuple(block_ids), num_tokens)
        else:
            pinned = set(self._pins.get(request.request_id, ()))
            num_valid = 0
            for block_id, key in zip(prefix.block_ids, request.block_hashes):
                if block_id not in pinned and self._block_keys[block_id] != key:
                    break
                num_valid += 1
            if num_valid < len(prefix.block_ids):
                prefix = CachedPrefix(prefix.block_ids[:num_valid], num_valid * self.block_size)
        request.cached_prefix = prefix
        return prefix

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        The block table must then cover ``request.num_computed_tokens +
        len(computed_block_ids) * block_size + num_new_tokens`` tokens.
        ``computed_block_ids`` (from ``get_computed_blocks``, only for a request
        without blocks) are shared and put first; the caller then advances
        ``num_computed_tokens`` by their tokens. Returns False and changes
        nothing when there are not enough free blocks.
        """
        if computed_block_ids and request.block_ids:
            raise ValueError("computed blocks can only start an empty block table")
        num_tokens = request.num_computed_tokens + len(computed_block_ids) * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.num_blocks_for(num_tokens) - len(request.block_ids) - len(computed_block_ids))
        # Reviving a cached block that sits in the free queue also consumes it.
        num_revived = sum(1 for b in computed_block_ids if self._ref_counts[b] == 0)
        if num_new_blocks + num_revived > len(self._free_queue):
            return False
        for block_id in computed_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1
        request.block_ids.extend(computed_block_ids)
        if computed_block_ids:
            self._num_registered[request.request_id] = len(computed_block_ids)
        for _ in range(num_new_blocks):
            request.block_ids.append(self._take_next_block(request.block_ids))
        if num_new_blocks:
            self._keep_room_after(request)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache.

        Call after the model step that computed them (``num_computed_tokens``
        already advanced), so that no other request can hit a block whose K/V
        is not written yet.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        keys = self._block_keys_of(request, num_full)
        for i in range(start, num_full):
            block_id, key = request.block_ids[i], keys[i]
            if self._block_keys[block_id] is None and key not in self._key_to_block:
                # A block with the same key computed by another request wins;
                # this one then stays anonymous and is reused first once freed.
                self._block_keys[block_id] = key
                self._key_to_block[key] = block_id
                self.events.block_stored(key)
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Drop the request's block table. Idempotent.

        Blocks go back in reverse order so that the tail of a prefix, the part
        least likely to be shared, is evicted before its head.
        """
        self._release(request.block_ids)
        request.block_ids.clear()
        self._num_registered.pop(request.request_id, None)

    def pin(self, owner: str, block_ids: Sequence[int]) -> None:
        """Hold one reference on each of ``block_ids`` for ``owner``.

        The blocks must be cached (from ``get_computed_blocks``); a free one is
        revived. Replaces what ``owner`` had pinned before.
        """
        if any(self._block_keys[b] is None for b in block_ids):
            raise ValueError("only prefix-cached blocks can be pinned")
        self.hold(owner, block_ids)

    def hold(self, owner: str, block_ids: Sequence[int]) -> None:
        """Like ``pin``, for blocks that need not be cached: a finished prefill's K/V held until
        its push to a decode instance lands. ``owner`` must not be a request id (its pins differ)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1
        self.unpin(owner)
        if block_ids:
            self._pins[owner] = list(block_ids)

    def pin_computed_prefix(self, request: Request, num_blocks: int) -> bool:
        """Pin, for ``request``, the cached blocks holding its first ``num_blocks`` computed blocks' K/V.

        They are the blocks its block table registered, or those another
        request registered first under the same keys. Replaces what it had
        pinned before (a shorter run of the same chain). False, pinning
        nothing new, when a block is not in the prefix cache.
        """
        if not self.enable_prefix_caching or num_blocks * self.block_size > request.num_computed_tokens:
            return False
        block_ids = [self._key_to_block.get(key) for key in self._block_keys_of(request, num_blocks)]
        if None in block_ids:
            return False
        self.pin(request.request_id, [b for b in block_ids if b is not None])
        return True

    def unpin(self, owner: str) -> None:
        """Drop ``owner``'s pins. Idempotent."""
        self._release(self._pins.pop(owner, ()))

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (blocks in use keep their contents)."""
        for key in self._key_to_block:
            self.events.block_removed(key)
        self._key_to_block.clear()
        self._block_keys = [None] * self.num_blocks

    def check_integrity(self, requests: Iterable[Request] | None = None) -> None:
        """Raise AssertionError unless the bookkeeping is consistent.

        With ``requests`` (every request holding blocks), also check that each
        block's ref count equals the number of block tables and pins holding it.
        """
        num_used = sum(1 for c in self._ref_counts if c > 0)
        check(num_used + len(self._free_queue) == self.num_blocks, "free + used != total")
        for block_id in self._free_queue:
            check(self._ref_counts[block_id] == 0, f"free block {block_id} is referenced")
        check(all(c >= 0 for c in self._ref_counts), "negative ref count")
        for key, block_id in self._key_to_block.items():
            check(self._block_keys[block_id] == key, f"key map and block {block_id} disagree")
        check(
            sum(k is not None for k in self._block_keys) == len(self._key_to_block),
            "a block carries a key missing from the key map",
        )
        if requests is not None:
            expected = [0] * self.num_blocks
            for block_ids in [r.block_ids for r in requests] + list(self._pins.values()):
                for block_id in block_ids:
                    expected[block_id] += 1
            check(expected == self._ref_counts, "ref counts differ from block tables and pins")

    # ---------------------------------------------------------------- helpers
    def _release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, in reverse (tail of a prefix first)."""
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                if self._block_keys[block_id] is None:
                    # Nothing cached in it: hand it out before any cached block.
                    self._free_queue.move_to_end(block_id, last=False)

    def _take_next_block(self, block_ids: list[int]) -> int:
        """The block right after the table's last one if it is free and blank, else the LRU front.

        Contiguous tables let the runner read a request's K/V in place instead
        of gathering it (``attention.py``). A blank block costs nothing to take
        out of LRU order.
        """
        if block_ids:
            after = block_ids[-1] + 1
            if after < self.num_blocks and self._block_keys[after] is None and after in self._free_queue:
                del self._free_queue[after]
                self._ref_counts[after] = 1
                return after
        return self._take_free_block()

    def _keep_room_after(self, request: Request) -> None:
        """Move the blank free blocks that would extend the table to its full length to the back.

        A soft reservation: other requests take them last, so the request
        usually grows in place; under memory pressure they are used like any
        other block (after evictable cached blocks).
        """
        expected = self.num_blocks_for(request.num_prompt_tokens + request.sampling.max_tokens - 1)
        room = min(expected - len(request.block_ids), _MAX_KEPT_ROOM_BLOCKS)
        last = request.block_ids[-1]
        for block_id in range(last + 1, min(last + 1 + room, self.num_blocks)):
            if self._block_keys[block_id] is not None or block_id not in self._free_queue:
                break
            self._free_queue.move_to_end(block_id)

    def _take_free_block(self) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        key = self._block_keys[block_id]
        if key is not None:
            # Evict: the block's old contents are about to be overwritten.
            del self._key_to_block[key]
            self._block_keys[block_id] = None
            self.events.block_removed(key)
        self._ref_counts[block_id] = 1
        return block_id

    def _block_keys_of(self, request: Request, num_blocks: int) -> list[bytes]:
        """Keys of the first ``num_blocks`` full blocks, memoised on the request (``services/common/prefix_keys.py``:
        the proxy keys a prompt the same way to route it where its prefix is cached)."""
        return extend_block_keys(
            request.block_hashes,
            num_blocks,
            self.block_size,
            functools.partial(token_slice, request),
            request.mm_spans,
            request.cache_salt,
            request.private_kv_salt,
            request.private_kv_from,
        )

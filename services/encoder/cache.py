"""Byte-bounded LRU cache of image embeddings, keyed by ``mm_hash`` and the pixels encoded.

The key is ``cache_key(mm_hash, pixels, grid)``: the caller's hash
alone would let one Encode call (a bug, or a peer holding the token) make
a popular hash answer with another image's embedding for everyone after
it. With the digest of the very tensor that was encoded in the key, a hit
is always the embedding of the pixels asked for.

The batcher's worker thread inserts and the event loop reads, so every
operation takes one lock. Entries are CPU tensors that nothing mutates: a
hit hands out the cached tensor itself, without a copy.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch


def cache_key(mm_hash: str, pixel_values: torch.Tensor, grid: Sequence[int] | None = None) -> str:
    """The cache and single-flight key of one image: its hash, then a BLAKE2b-128 digest of the pixel
    tensor encoded (dtype, shape, bytes) and of its patch grid. Hashes every byte, and hashlib releases
    the GIL: call it in a thread."""
    digest = hashlib.blake2b(digest_size=16)
    grid_text = "" if grid is None else str(tuple(grid))
    digest.update(f"{pixel_values.dtype}:{tuple(pixel_values.shape)}:{grid_text}\0".encode())
    flat = pixel_values.detach().contiguous().reshape(-1).view(torch.uint8)
    digest.update(flat.numpy().data)  # the array's buffer as a memoryview
    return f"{mm_hash}/{digest.hexdigest()}"


def tensor_num_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (what the cache and push budgets count)."""
    return tensor.numel() * tensor.element_size()


class EmbeddingCache:
    """LRU over ``cache_key -> embedding`` (``[num_tokens, ...]``, DeepStack rows included) holding at most ``capacity_bytes``.

    Invariant: ``bytes == sum of entry sizes <= capacity_bytes``. An entry
    larger than the whole capacity is never stored.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self._capacity = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def bytes(self) -> int:
        """Bytes currently held."""
        with self._lock:
            return self._num_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        """The cached embedding (now most recently used), or None."""
        with self._lock:
            tensor = self._entries.get(key)
            if tensor is not None:
                self._entries.move_to_end(key)
            return tensor

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Stores ``tensor`` (replacing any entry for ``key``), evicting LRU entries.

        Returns False when the tensor alone exceeds the capacity (not stored).
        """
        size = tensor_num_bytes(tensor)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_bytes -= tensor_num_bytes(old)
            if size > self._capacity:
                return False
            while self._num_bytes + size > self._capacity:
                _, evicted = self._entries.popitem(last=False)
                self._num_bytes -= tensor_num_bytes(evicted)
            self._entries[key] = tensor
            self._num_bytes += size
            return True

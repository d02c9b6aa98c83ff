"""Byte-bounded LRU cache of image embeddings, keyed by ``mm_hash``.

The batcher's worker thread inserts and the event loop reads, so every
operation takes one lock. Entries are CPU tensors that nothing mutates: a
hit hands out the cached tensor itself, without a copy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


def tensor_num_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (what the cache and push budgets count)."""
    return tensor.numel() * tensor.element_size()


class EmbeddingCache:
    """LRU over ``mm_hash -> Tensor[num_tokens, hidden]`` holding at most ``capacity_bytes``.

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

    def __contains__(self, mm_hash: object) -> bool:
        with self._lock:
            return mm_hash in self._entries

    def get(self, mm_hash: str) -> torch.Tensor | None:
        """The cached embedding (now most recently used), or None."""
        with self._lock:
            tensor = self._entries.get(mm_hash)
            if tensor is not None:
                self._entries.move_to_end(mm_hash)
            return tensor

    def put(self, mm_hash: str, tensor: torch.Tensor) -> bool:
        """Stores ``tensor`` (replacing any entry for ``mm_hash``), evicting LRU entries.

        Returns False when the tensor alone exceeds the capacity (not stored).
        """
        size = tensor_num_bytes(tensor)
        with self._lock:
            old = self._entries.pop(mm_hash, None)
            if old is not None:
                self._num_bytes -= tensor_num_bytes(old)
            if size > self._capacity:
                return False
            while self._num_bytes + size > self._capacity:
                _, evicted = self._entries.popitem(last=False)
                self._num_bytes -= tensor_num_bytes(evicted)
            self._entries[mm_hash] = tensor
            self._num_bytes += size
            return True

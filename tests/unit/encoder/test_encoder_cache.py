"""EmbeddingCache: LRU eviction by bytes, replacement, oversize entries."""

from __future__ import annotations

import threading

import pytest
import torch

from services.encoder.cache import EmbeddingCache, tensor_num_bytes


def row(value: float, num_floats: int = 4) -> torch.Tensor:
    return torch.full((1, num_floats), value, dtype=torch.float32)  # 16 bytes by default


def test_get_put_and_byte_accounting() -> None:
    cache = EmbeddingCache(64)
    assert cache.get("a") is None
    assert cache.put("a", row(1.0))
    assert len(cache) == 1 and cache.bytes == 16 and "a" in cache
    assert torch.equal(cache.get("a"), row(1.0))


def test_evicts_least_recently_used_by_bytes() -> None:
    cache = EmbeddingCache(48)  # three 16-byte entries
    for key in ("a", "b", "c"):
        cache.put(key, row(1.0))
    cache.get("a")  # a is now most recent: b is the LRU entry
    cache.put("d", row(2.0))
    assert "b" not in cache
    assert {"a", "c", "d"} == {k for k in "abcd" if k in cache}
    assert cache.bytes == 48


def test_large_entry_evicts_several() -> None:
    cache = EmbeddingCache(64)
    for key in ("a", "b", "c", "d"):
        cache.put(key, row(1.0))
    cache.put("big", row(3.0, num_floats=12))  # 48 bytes: three old entries must go
    assert len(cache) == 2 and "d" in cache and "big" in cache
    assert cache.bytes == 64


def test_replace_same_key_updates_bytes() -> None:
    cache = EmbeddingCache(100)
    cache.put("a", row(1.0))
    cache.put("a", row(2.0, num_floats=8))
    assert len(cache) == 1 and cache.bytes == 32
    assert cache.get("a")[0, 0].item() == 2.0


def test_entry_larger_than_capacity_is_not_stored() -> None:
    cache = EmbeddingCache(16)
    cache.put("a", row(1.0))
    assert not cache.put("huge", row(1.0, num_floats=5))
    assert "huge" not in cache and "a" in cache and cache.bytes == 16


def test_zero_capacity_disables_caching() -> None:
    cache = EmbeddingCache(0)
    assert not cache.put("a", row(1.0))
    assert len(cache) == 0 and cache.bytes == 0


def test_negative_capacity_rejected() -> None:
    with pytest.raises(ValueError):
        EmbeddingCache(-1)


def test_concurrent_puts_keep_invariant() -> None:
    cache = EmbeddingCache(16 * 10)

    def writer(prefix: str) -> None:
        for i in range(200):
            cache.put(f"{prefix}{i}", row(float(i)))
            cache.get(f"{prefix}{i // 2}")

    threads = [threading.Thread(target=writer, args=(p,)) for p in "xyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 10
    assert cache.bytes == 10 * tensor_num_bytes(row(0.0))

"""What PD's caches report for the proxies' cache-aware routing (services/pd/engine/cache_events.py)."""

from __future__ import annotations

from core_support import EmbeddingDouble, FakeClock, make_core

from services.common.prefix_keys import prompt_block_keys
from services.pd.engine.cache_events import CacheChanges, CacheEventRecorder
from services.pd.engine.embedding_cache import EmbeddingCache
from services.pd.engine.kv_cache import KVCacheManager
from services.pd.engine.request import MultiModalSpan, Request, SamplingParams

BS = 4
H1, H2, H3 = "1" * 64, "2" * 64, "3" * 64


def compute_all(kv: KVCacheManager, request: Request) -> None:
    """Admit with prefix hits, 'compute' every token but the last, register blocks."""
    hit_ids, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - 1 - num_hit, hit_ids)
    request.num_computed_tokens = request.num_tokens - 1
    kv.cache_full_blocks(request)


def test_nothing_is_recorded_until_enabled():
    recorder = CacheEventRecorder()
    kv = KVCacheManager(num_blocks=8, block_size=BS, events=recorder)
    compute_all(kv, Request("a", list(range(13)), SamplingParams()))
    assert recorder.take() is None
    recorder.enable()
    recorder.enable()  # idempotent
    assert recorder.take() is None


def test_a_batch_nets_each_key_to_its_last_change():
    recorder = CacheEventRecorder()
    recorder.enable()
    recorder.block_stored(b"a")
    recorder.block_removed(b"a")
    recorder.block_stored(b"b")
    recorder.block_removed(b"c")
    recorder.embedding_stored(H1, 5)
    recorder.embedding_removed(H1)
    recorder.embedding_removed(H2)
    recorder.embedding_stored(H2, 7)
    changes = recorder.take()
    assert changes == CacheChanges((b"b",), (b"a", b"c"), ((H2, 7),), (H1,))
    assert changes.num_changes == 5
    assert recorder.take() is None


def test_kv_cache_reports_the_keys_it_registers_and_evicts():
    recorder = CacheEventRecorder()
    recorder.enable()
    kv = KVCacheManager(num_blocks=4, block_size=BS, events=recorder)
    spans = [MultiModalSpan(H1, 2, 3)]
    a = Request("a", list(range(13)), SamplingParams(), mm_spans=spans)
    compute_all(kv, a)
    keys = prompt_block_keys(a.prompt_token_ids, spans, BS)  # what the proxy computes for this prompt
    assert recorder.take() == CacheChanges(blocks_stored=tuple(keys))
    assert kv.cached_keys() == keys
    kv.free(a)
    b = Request("b", list(range(100, 116)), SamplingParams())
    compute_all(kv, b)  # 4 blocks needed: all of a's cached blocks are evicted
    changes = recorder.take()
    assert set(changes.blocks_removed) == set(keys)
    assert changes.blocks_stored == tuple(prompt_block_keys(b.prompt_token_ids, [], BS))
    kv.free(b)
    kv.reset_prefix_cache()
    assert set(recorder.take().blocks_removed) == set(kv_keys_of(b))
    kv.check_integrity()


def kv_keys_of(request: Request) -> list[bytes]:
    return prompt_block_keys(request.prompt_token_ids, request.mm_spans, BS)


def test_embedding_cache_reports_ready_and_evicted_entries_only():
    recorder = CacheEventRecorder()
    recorder.enable()
    cache = EmbeddingCache(10, events=recorder)
    (_, _, rid1), (_, _, rid2) = cache.preallocate("r1", [(H1, 5), (H2, 5)], 10.0, 0.0).items
    assert recorder.take() is None  # RESERVED is not held yet
    cache.fill("r1", rid1, H1, 1.0)
    assert recorder.take() == CacheChanges(embeddings_stored=((H1, 5),))
    cache.cancel_request("r1")  # H2 was never filled: dropped without a word
    assert recorder.take() is None
    assert cache.ready_entries() == [(H1, 5)]
    cache.preallocate("r2", [(H3, 10)], 10.0, 2.0)  # evicts H1
    assert recorder.take() == CacheChanges(embeddings_removed=(H1,))
    cache.check_integrity()


def test_the_core_snapshots_both_caches_and_records_from_then_on():
    core = make_core(clock=FakeClock(), num_blocks=16, block_size=BS)
    assert core.take_cache_changes() is None
    core.add_request(Request("text", list(range(1, 11)), SamplingParams(max_tokens=1, temperature=0)))
    while core.has_work():
        core.step()
    assert core.take_cache_changes() is None  # nobody subscribed: nothing recorded
    snapshot = core.cache_snapshot()
    assert snapshot.block_size == BS and snapshot.embeddings == ()
    assert list(snapshot.block_keys) == prompt_block_keys(list(range(1, 11)), [], BS)
    span = MultiModalSpan(H1, 1, 4)
    [allocation] = core.preallocate("img", [span], 5.0, list(range(12)))
    core.fill("img", allocation.reservation_id, H1, EmbeddingDouble(4))
    assert core.take_cache_changes() == CacheChanges(embeddings_stored=((H1, 4),))
    assert core.cache_snapshot().embeddings == ((H1, 4),)
    core.abort("img")
    core.check_integrity()

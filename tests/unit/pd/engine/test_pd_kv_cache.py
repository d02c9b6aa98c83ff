"""KVCacheManager: allocation, ref counts, prefix caching keyed by images, LRU reuse."""

from __future__ import annotations

import pytest

from services.pd.engine.kv_cache import KVCacheManager
from services.pd.engine.preallocated import Preallocated
from services.pd.engine.request import MultiModalSpan, Request, SamplingParams

BS = 4


def make_request(request_id: str, token_ids: list[int], spans: list[MultiModalSpan] = ()) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(), mm_spans=list(spans))


def compute_all(kv: KVCacheManager, request: Request) -> None:
    """Admit with prefix hits, 'compute' every token but the last, register blocks."""
    hit_ids, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - 1 - num_hit, hit_ids)
    request.num_computed_tokens = request.num_tokens - 1
    kv.cache_full_blocks(request)


@pytest.fixture
def kv():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    yield manager
    manager.check_integrity()


def test_allocate_covers_tokens_and_free_is_idempotent(kv):
    request = make_request("a", range(10))
    assert kv.allocate_slots(request, 10)
    assert len(request.block_ids) == 3 and kv.num_free_blocks == 5
    kv.check_integrity([request])
    request.num_computed_tokens = 10
    assert kv.allocate_slots(request, 2)  # 12 tokens still fit in 3 blocks
    assert len(request.block_ids) == 3
    assert kv.allocate_slots(request, 3)
    assert len(request.block_ids) == 4
    assert kv.usage == pytest.approx(0.5)
    kv.free(request)
    kv.free(request)
    assert request.block_ids == [] and kv.num_free_blocks == 8


def test_allocate_fails_without_changing_anything(kv):
    big = make_request("big", range(28))
    assert kv.allocate_slots(big, 28)  # 7 of 8 blocks
    other = make_request("other", range(100, 108))
    assert not kv.allocate_slots(other, 8)
    assert other.block_ids == [] and kv.num_free_blocks == 1
    kv.check_integrity([big, other])
    kv.free(big)


def test_prefix_hit_shares_blocks_and_never_covers_last_token(kv):
    a = make_request("a", range(13))  # computes 12 tokens: 3 full blocks
    compute_all(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    b = make_request("b", range(12))
    # The block holding b's last token is never a hit: it must be computed to sample.
    assert kv.get_computed_blocks(b) == (a_blocks[:2], 8)
    c = make_request("c", list(range(12)) + [99])
    assert kv.get_computed_blocks(c) == (a_blocks[:3], 12)


def test_hit_on_running_request_increments_ref_counts(kv):
    a = make_request("a", range(9))
    compute_all(kv, a)
    b = make_request("b", list(range(8)) + [50, 51])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert hit_ids == a.block_ids[:2] and num_hit == 8
    assert kv.allocate_slots(b, 2, hit_ids)
    assert b.block_ids[:2] == a.block_ids[:2] and len(b.block_ids) == 3
    kv.check_integrity([a, b])
    kv.free(a)
    kv.check_integrity([b])  # shared blocks still referenced by b
    assert kv.num_free_blocks == 8 - 3
    kv.free(b)


def test_blocks_registered_only_after_compute(kv):
    a = make_request("a", range(9))
    assert kv.allocate_slots(a, 8)
    b = make_request("b", range(9))
    assert kv.get_computed_blocks(b) == ([], 0)  # allocated, not computed yet
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    assert kv.get_computed_blocks(b)[1] == 8
    kv.free(a)


def image_prompt(mm_hash: str) -> tuple[list[int], list[MultiModalSpan]]:
    """Two text tokens, six image placeholders (0), three text tokens."""
    return [1, 2] + [0] * 6 + [3, 4, 5], [MultiModalSpan(mm_hash, 2, 6)]


def test_different_images_at_same_position_never_share_kv(kv):
    tokens, spans = image_prompt("cat")
    a = make_request("a", tokens, spans)
    compute_all(kv, a)
    kv.free(a)
    tokens_b, spans_b = image_prompt("dog")
    assert tokens_b == tokens  # identical placeholder tokens
    b = make_request("b", tokens_b, spans_b)
    assert kv.get_computed_blocks(b) == ([], 0)  # the first block already holds image rows


def test_same_image_shares_kv(kv):
    tokens, spans = image_prompt("cat")
    a = make_request("a", tokens, spans)
    compute_all(kv, a)
    kv.free(a)
    b = make_request("b", tokens, spans)
    assert kv.get_computed_blocks(b)[1] == 8


def test_same_image_at_another_offset_does_not_share_kv(kv):
    a_tokens, a_spans = image_prompt("cat")
    # Same tokens, but the image starts one position later (a placeholder-looking text token).
    b = make_request("b", a_tokens, [MultiModalSpan("cat", 3, 5)])
    a = make_request("a", a_tokens, a_spans)
    assert a.prompt_token_ids == b.prompt_token_ids
    compute_all(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(b) == ([], 0)


def test_one_image_claimed_with_another_grid_does_not_share_kv(kv):
    # Second review, finding 10: Qwen prefix-cache keys left out the image grid, so a
    # token holder could plant K/V computed at the wrong 3-D positions under an image.
    tokens = [1, 2] + [0] * 4 + [3, 4, 5]
    a = make_request("a", tokens, [MultiModalSpan("cat", 2, 4, (1, 2, 2))])
    compute_all(kv, a)
    kv.free(a)
    same = make_request("same", tokens, [MultiModalSpan("cat", 2, 4, (1, 2, 2))])
    assert kv.get_computed_blocks(same)[1] == 8
    other = make_request("other", tokens, [MultiModalSpan("cat", 2, 4, (1, 1, 4))])
    assert kv.get_computed_blocks(other) == ([], 0)


def test_text_before_an_image_still_hits(kv):
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] + [0] * 4 + [9]
    a = make_request("a", tokens, [MultiModalSpan("cat", 8, 4)])
    compute_all(kv, a)
    kv.free(a)
    b = make_request("b", tokens, [MultiModalSpan("dog", 8, 4)])
    assert kv.get_computed_blocks(b)[1] == 8  # the two text blocks only


def test_freed_blocks_reused_lru_tail_first_and_evicted_from_hash_map(kv):
    a = make_request("a", range(14))  # computes 3 full blocks + 1 partial
    compute_all(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    # 4 never-used blocks go first, then a's partial (uncached) block, then a's
    # cached blocks from the tail: a's head survives longest.
    filler = make_request("f", range(200, 220))  # 5 blocks
    assert kv.allocate_slots(filler, 20)
    assert a_blocks[3] in filler.block_ids
    assert not set(a_blocks[:3]) & set(filler.block_ids)
    more = make_request("m", range(300, 304))  # 1 more block: evicts a's tail block
    assert kv.allocate_slots(more, 4)
    assert more.block_ids == [a_blocks[2]]
    b = make_request("b", range(14))
    assert kv.get_computed_blocks(b) == (a_blocks[:2], 8)
    kv.check_integrity([filler, more])
    kv.free(filler)
    kv.free(more)


def test_reviving_cached_free_blocks_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", range(9))
    compute_all(kv, a)  # 3 blocks, 2 cached
    kv.free(a)
    b = make_request("b", list(range(8)) + [7] * 9)
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # 2 revived + 3 new > 3 blocks: refused, nothing taken.
    assert not kv.allocate_slots(b, 9, hit_ids)
    assert kv.num_free_blocks == 3 and b.block_ids == []
    assert kv.allocate_slots(b, 4, hit_ids)
    kv.check_integrity([b])
    kv.free(b)
    kv.check_integrity()


def test_duplicate_content_keeps_first_block_cached(kv):
    a = make_request("a", range(9))
    b = make_request("b", range(9))
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 8)
    a.num_computed_tokens = b.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.cache_full_blocks(b)
    assert kv.num_cached_blocks == 2
    c = make_request("c", range(9))
    assert kv.get_computed_blocks(c)[0] == a.block_ids[:2]
    kv.check_integrity([a, b])
    kv.free(a)
    kv.free(b)


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", range(9))
    compute_all(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert kv.num_cached_blocks == 0
    kv.check_integrity()


def test_integrity_catches_inconsistency(kv):
    a = make_request("a", range(4))
    assert kv.allocate_slots(a, 4)
    with pytest.raises(AssertionError):
        kv.check_integrity([])  # a's block is referenced by nobody
    kv.free(a)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=4)
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(4))
    assert kv.allocate_slots(a, 4)
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 1, [0])
    kv.free(a)


def test_pinned_cached_blocks_survive_eviction_until_unpinned(kv):
    a = make_request("a", range(9))  # 2 full cached blocks
    compute_all(kv, a)
    kv.free(a)
    hit_ids, num_hit = kv.get_computed_blocks(make_request("probe", range(9)))
    assert num_hit == 8
    kv.pin("owner", hit_ids)  # revives them out of the free queue
    assert kv.num_pinned_blocks == 2 and kv.num_free_blocks == 6
    kv.check_integrity([])
    filler = make_request("filler", range(100, 124))
    assert kv.allocate_slots(filler, 24)  # takes every free block ...
    assert not set(filler.block_ids) & set(hit_ids)
    assert kv.get_computed_blocks(make_request("b", range(9))) == (hit_ids, 8)  # ... but not the pinned ones
    kv.pin("owner", hit_ids[:1])  # re-pinning replaces the old pin
    assert kv.num_pinned_blocks == 1 and kv.num_free_blocks == 1
    kv.unpin("owner")
    kv.unpin("owner")  # idempotent
    assert kv.num_pinned_blocks == 0 and kv.num_free_blocks == 2
    kv.check_integrity([filler])
    kv.free(filler)


def test_pin_shares_blocks_with_a_running_request(kv):
    a = make_request("a", range(9))
    compute_all(kv, a)  # a still holds its blocks
    hit_ids, _ = kv.get_computed_blocks(make_request("probe", range(9)))
    kv.pin("owner", hit_ids)
    kv.check_integrity([a])  # each hit block: one table + one pin
    kv.free(a)
    assert kv.num_free_blocks == 8 - 2  # the pin keeps both alive
    kv.unpin("owner")
    assert kv.num_free_blocks == 8 and kv.get_computed_blocks(make_request("c", range(9)))[1] == 8


def test_only_cached_blocks_can_be_pinned(kv):
    a = make_request("a", range(6))
    assert kv.allocate_slots(a, 6)  # allocated, never registered
    with pytest.raises(ValueError, match="cached"):
        kv.pin("owner", a.block_ids[:1])
    assert kv.num_pinned_blocks == 0
    kv.check_integrity([a])
    kv.free(a)


def _grow(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Decode ``num_tokens`` more tokens, one allocation per token (as steps do)."""
    for _ in range(num_tokens):
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1


def test_tables_grow_in_place_when_room_was_kept():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=9))  # grows to 16 tokens: 4 blocks
    b = Request("b", list(range(50, 58)), SamplingParams(max_tokens=9))
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 8)
    a.num_computed_tokens = b.num_computed_tokens = 8
    assert a.block_ids == [0, 1] and b.block_ids == [4, 5]  # b skipped a's room (2, 3)
    _grow(kv, a, 8)
    _grow(kv, b, 8)
    assert a.block_ids == [0, 1, 2, 3] and b.block_ids == [4, 5, 6, 7]
    kv.check_integrity([a, b])
    kv.free(a)
    kv.free(b)


def test_kept_room_is_used_by_others_under_pressure():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = Request("a", list(range(4)), SamplingParams(max_tokens=9))  # would grow to 3 blocks
    assert kv.allocate_slots(a, 4)
    b = Request("b", list(range(50, 62)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(b, 12)  # needs 3: takes a's room too
    assert sorted(a.block_ids + b.block_ids) == [0, 1, 2, 3]
    assert not kv.allocate_slots(a, 1 + 4)
    kv.check_integrity([a, b])
    kv.free(a)
    kv.free(b)


def test_a_cache_salt_seeds_the_first_block_so_tenants_never_share_kv(kv):
    """Security review, the cross-user side channel: prefix-cache hits told a client what
    another had sent. Block keys start from the tenant's salt, as vLLM's cache_salt does."""
    tenant_a, tenant_b = "a" * 64, "b" * 64
    a = Request("a", list(range(13)), SamplingParams(), cache_salt=tenant_a)
    compute_all(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    for other in (Request("b", list(range(13)), SamplingParams(), cache_salt=tenant_b), make_request("c", range(13))):
        assert kv.get_computed_blocks(other) == ([], 0)
    again = Request("a2", list(range(13)), SamplingParams(), cache_salt=tenant_a)
    assert kv.get_computed_blocks(again) == (a_blocks[:3], 12)
    # The salt changes the first key, and the chain carries it to every later one.
    assert set(again.block_hashes).isdisjoint(_keys(kv, 13))


def _keys(kv: KVCacheManager, num_tokens: int) -> list[bytes]:
    request = make_request("keys", range(num_tokens))
    kv.get_computed_blocks(request)
    return request.block_hashes


def test_a_generate_under_another_salt_does_not_take_over_its_preallocates_block_keys():
    probe = Request("r", list(range(13)), SamplingParams(), cache_salt="a" * 64)
    preallocated = Preallocated(probe, deadline=1.0, covers_images=False)
    assert preallocated.matches(Request("r", list(range(13)), SamplingParams(), cache_salt="a" * 64))
    assert not preallocated.matches(Request("r", list(range(13)), SamplingParams(), cache_salt="b" * 64))
    assert not preallocated.matches(make_request("r", range(13)))

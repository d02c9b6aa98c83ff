"""The proxy keys a prompt exactly as PD keys its cache (services/common/prefix_keys.py), or routing by cache
would chase blocks no PD holds."""

from __future__ import annotations

import pytest

from services.common.prefix_keys import KEY_BYTES, prompt_block_keys
from services.pd.engine.kv_cache import KVCacheManager
from services.pd.engine.request import MultiModalSpan, Request, SamplingParams
from services.proxy.backends.cache_index import PromptImage, RoutedPrompt

SALT = "ab" * 32


def _pd_keys(token_ids, spans, block_size, cache_salt=""):
    """The keys PD's KV cache registers for a prompt: every block a later request could hit."""
    kv = KVCacheManager(num_blocks=256, block_size=block_size)
    request = Request("r", list(token_ids), SamplingParams(), mm_spans=list(spans), cache_salt=cache_salt)
    return kv._block_keys_of(request, (len(token_ids) - 1) // block_size)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("cache_salt", ["", SALT])
@pytest.mark.parametrize("grid", [None, (1, 2, 3)])
@pytest.mark.parametrize("frames", [(), (30, 34)], ids=["one_run", "video_runs"])
def test_proxy_and_pd_key_a_prompt_alike(block_size, cache_salt, grid, frames):
    token_ids = [(7 * i) % 101 for i in range(70)]
    spans = [MultiModalSpan("a" * 64, 5, 6, grid), MultiModalSpan("b" * 64, 30, 6, grid, frame_offsets=frames)]
    images = tuple(PromptImage(s.mm_hash, s.offset, s.num_tokens, s.grid, s.frame_offsets) for s in spans)
    expected = _pd_keys(token_ids, spans, block_size, cache_salt)
    assert RoutedPrompt(token_ids, images, cache_salt).keys(block_size) == expected
    assert prompt_block_keys(token_ids, spans, block_size, cache_salt) == expected
    assert len(expected) == 69 // block_size and all(len(k) == KEY_BYTES for k in expected)


def test_the_keys_tell_images_grids_and_salts_apart():
    token_ids = list(range(40))
    keys = prompt_block_keys(token_ids, [PromptImage("a" * 64, 4, 8)], 16)
    assert keys != prompt_block_keys(token_ids, [PromptImage("b" * 64, 4, 8)], 16)
    assert keys != prompt_block_keys(token_ids, [PromptImage("a" * 64, 4, 8, (1, 2, 4))], 16)
    assert keys != prompt_block_keys(token_ids, [PromptImage("a" * 64, 4, 8)], 16, SALT)
    # A prompt that extends another shares its keys: a chain names the whole prefix.
    longer = prompt_block_keys([*token_ids, 1, 2, 3, 4, 5, 6, 7, 8, 9], [PromptImage("a" * 64, 4, 8)], 16)
    assert longer[: len(keys)] == keys


def test_the_block_holding_the_last_token_is_never_keyed():
    assert prompt_block_keys(list(range(16)), [], 16) == []  # PD computes the last token to sample from it
    assert len(prompt_block_keys(list(range(17)), [], 16)) == 1
    with pytest.raises(ValueError):
        prompt_block_keys([1, 2], [], 0)

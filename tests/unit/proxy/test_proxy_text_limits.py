"""The characters-per-token bound that refuses over-long text before tokenizing it.

The property that matters: a prompt that fits is never refused. It is
checked against the tiny checkpoint's real tokenizer with texts built to
pack as many characters into each token as its vocabulary allows.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from services.proxy.errors import PromptTooLongError
from services.proxy.prompt.text_limits import COMPOSITION_SHRINK, TextLimit, chars_per_token_bound


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from services.common.models import load_adapter

    return load_adapter(str(tiny_model_dir)).load_processor().tokenizer


def _trained(model, pre_tokenizer=None, normalizer=None) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(model)
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    corpus = ["the quick brown fox jumps over the lazy dog", "lorem ipsum dolor sit amet"] * 20
    trainer_cls = {models.BPE: trainers.BpeTrainer, models.WordPiece: trainers.WordPieceTrainer}[type(model)]
    tokenizer.train_from_iterator(corpus, trainer_cls(vocab_size=80, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_the_bound_is_the_longest_vocabulary_entry(tiny_tokenizer):
    longest = max(len(token) for token in tiny_tokenizer.get_vocab())
    assert chars_per_token_bound(tiny_tokenizer) == longest


def test_composing_normalizers_widen_the_bound():
    plain = _trained(models.BPE(), pre_tokenizers.Metaspace())
    composing = _trained(models.BPE(), pre_tokenizers.Metaspace(), normalizers.NFKC())
    assert chars_per_token_bound(composing) == COMPOSITION_SHRINK * max(len(t) for t in composing.get_vocab())
    assert chars_per_token_bound(plain) == max(len(t) for t in plain.get_vocab())


@pytest.mark.parametrize(
    "tokenizer",
    [
        lambda: _trained(models.BPE(unk_token="<unk>", fuse_unk=True), pre_tokenizers.Metaspace()),  # fused unknowns
        lambda: _trained(models.WordPiece(unk_token="<unk>"), pre_tokenizers.Metaspace()),  # a whole word -> [UNK]
        lambda: _trained(models.BPE(), pre_tokenizers.Whitespace()),  # drops whitespace
        lambda: _trained(models.BPE(), pre_tokenizers.Metaspace(), normalizers.Strip()),  # drops characters
        lambda: _trained(
            models.BPE(), pre_tokenizers.Metaspace(), normalizers.Replace(Regex(r"\s+"), " ")
        ),  # collapses runs
    ],
)
def test_tokenizers_that_can_swallow_runs_of_characters_get_no_bound(tokenizer):
    limit = TextLimit(tokenizer(), max_model_len=8)
    assert limit.max_chars is None
    limit.check(10**9, "prompt")  # nothing is refused before tokenizing


def test_over_long_text_is_refused_with_a_400_naming_no_input(tiny_tokenizer):
    limit = TextLimit(tiny_tokenizer, max_model_len=100)
    limit.check(limit.max_chars, "prompt")
    with pytest.raises(PromptTooLongError) as refused:
        limit.check(limit.max_chars + 1, "prompt")
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"


def test_a_prompt_that_fits_is_never_refused(tiny_tokenizer):
    # Texts that pack the most characters into each token: runs of the longest vocabulary entries.
    vocab = sorted(tiny_tokenizer.get_vocab(), key=len, reverse=True)
    decoded = [tiny_tokenizer.convert_tokens_to_string([token]) for token in vocab[:50]]
    rng = random.Random(0)
    max_model_len = 64
    limit = TextLimit(tiny_tokenizer, max_model_len)
    densest = 0.0
    for length in range(1, 200, 3):
        text = "".join(rng.choice(decoded) for _ in range(length))
        num_tokens = len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
        densest = max(densest, len(text) / num_tokens)
        if num_tokens < max_model_len:
            limit.check(len(text), "prompt")  # fits: must pass
    assert densest <= chars_per_token_bound(tiny_tokenizer)

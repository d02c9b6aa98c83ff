"""Offline, deterministic tokenizer for the built-in checkpoints.

A byte-level BPE trained with the ``tokenizers`` library on synthetic text that
is generated here from a seed, so no file or network is needed and the same
arguments always give the same vocabulary. Byte-level means any UTF-8 text
encodes without ``<unk>`` and decodes back to itself.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, UNK, PAD, IMAGE = "<s>", "</s>", "<unk>", "<pad>", "<image>"
# Trained first, so these get ids 0..4 in this order.
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IMAGE)

# Qwen2-VL's ChatML and vision markers (no BOS: Qwen tokenizers add nothing).
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
QWEN_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

_COMMON_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "I",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "hot",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
    "when",
    "up",
    "use",
    "your",
    "how",
    "said",
    "an",
    "each",
    "she",
    "which",
    "do",
    "their",
    "time",
    "if",
    "will",
    "way",
    "about",
    "many",
    "then",
    "them",
    "write",
    "would",
    "like",
    "so",
    "these",
    "her",
    "long",
    "make",
    "thing",
    "see",
    "him",
    "two",
    "has",
    "look",
    "more",
    "day",
    "could",
    "go",
    "come",
    "did",
    "number",
    "sound",
    "no",
    "most",
    "people",
    "my",
    "over",
    "know",
    "water",
    "than",
    "call",
    "first",
    "who",
    "may",
    "down",
    "side",
    "been",
    "now",
    "find",
    "image",
    "picture",
    "photo",
    "describe",
    "color",
    "red",
    "green",
    "blue",
    "white",
    "black",
    "cat",
    "dog",
    "car",
    "tree",
    "house",
    "person",
    "man",
    "woman",
    "left",
    "right",
    "top",
    "bottom",
    "small",
    "large",
    "what's",
    "where's",
    "there's",
    "it's",
    "don't",
    "can't",
    "I'm",
    "you're",
    "USER",
    "ASSISTANT",
    "SYSTEM",
    "assistant",
    "user",
]
_ONSETS = (
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "ch",
    "cl",
    "dr",
    "gr",
    "pl",
    "sh",
    "st",
    "th",
    "tr",
)
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck")
_UNICODE_WORDS = ("café", "naïve", "über", "año", "Ελλάδα", "привет", "日本語", "中文", "한국어", "🙂", "—", "…")
_PUNCT = (".", ",", "?", "!", ":", ";")


def _pseudo_words(rng: random.Random, count: int) -> list[str]:
    """Pronounceable non-words, so BPE has sub-word structure to learn beyond a fixed word list."""
    words = []
    for _ in range(count):
        syllables = rng.randint(1, 3)
        words.append("".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(syllables)))
    return words


def _sentence(rng: random.Random, vocabulary: list[str], weights: list[float]) -> str:
    words = rng.choices(vocabulary, weights=weights, k=rng.randint(3, 16))
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
    if rng.random() < 0.1:
        words.insert(rng.randrange(len(words)), rng.choice(_UNICODE_WORDS))
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    return text + rng.choice(_PUNCT)


def synthetic_corpus(num_lines: int, seed: int = 0) -> Iterator[str]:
    """Deterministic text: Zipf-weighted common words and pseudo-words, numbers, some non-ASCII."""
    rng = random.Random(seed)
    vocabulary = list(_COMMON_WORDS) + _pseudo_words(rng, 4 * len(_COMMON_WORDS) + num_lines // 4)
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(len(vocabulary))]
    for _ in range(num_lines):
        line = " ".join(_sentence(rng, vocabulary, weights) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.05:
            line = '{"key": "' + line + '", "n": ' + str(rng.randint(0, 999)) + "}"
        yield line


def train_tokenizer(
    vocab_size: int, num_lines: int, seed: int = 0, special_tokens: tuple[str, ...] = SPECIAL_TOKENS
) -> Tokenizer:
    """Byte-level BPE; with Llama's specials, ``<s>`` is prepended to every sequence (as Llama tokenizers do)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(synthetic_corpus(num_lines, seed), trainer=trainer)
    if BOS not in special_tokens:
        return tokenizer
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build_hf_tokenizer(vocab_size: int, num_lines: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """The trained tokenizer wrapped for ``transformers`` (``save_pretrained`` / ``AutoTokenizer``)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, num_lines, seed),
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def build_qwen_tokenizer(vocab_size: int, num_lines: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A Qwen2-VL-style tokenizer: ChatML and vision markers, ``<|im_end|>`` ends a turn, no BOS."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, num_lines, seed, QWEN_SPECIAL_TOKENS),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD},
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one token (transformers types ``convert_tokens_to_ids`` for a list too)."""
    value = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(value, int):
        raise TypeError("convert_tokens_to_ids returned no single id for one token")
    return value


def token_ids(tokenizer: PreTrainedTokenizerFast, tokens: list[str]) -> list[int]:
    """The ids of several tokens, in order."""
    return [token_id(tokenizer, token) for token in tokens]

"""Refusing text that cannot fit the context, before tokenizing it.

Tokenizing costs time in proportion to the text: a 30 MB prompt took 48 s
of the proxy's CPU only to be refused for its length. Here the length in
characters is compared with a bound that no prompt which fits can exceed:

    tokens >= characters / (max_chars_per_token * shrink)

``max_chars_per_token`` is the longest vocabulary entry (added tokens
included). For byte-level BPE an entry's length counts bytes, which is at
least the characters it covers; for a metaspace vocabulary it counts
characters; a byte-fallback entry such as ``<0xE2>`` is longer than its one
byte. ``shrink`` covers normalizers that make text shorter before it is
split: Unicode composition (NFC/NFKC: at most 3 code points become 1,
Hangul L+V+T) and fixed-string replacements. So a text of more than
``(max_model_len - 1) * max_chars_per_token * shrink`` characters has at least
``max_model_len`` tokens and would be refused after tokenizing anyway.

When the tokenizer can map an unbounded run of characters to one token
(fused or whole-word unknown tokens, normalizers or pre-tokenizers that drop
characters, regular-expression replacements) there is no such bound and
``TextLimit`` checks nothing: such a tokenizer is only ever refused after
tokenizing, within the body size limit.
"""

from __future__ import annotations

import json
from typing import Any

from services.proxy.errors import PromptTooLongError

COMPOSITION_SHRINK = 3
"""Most code points Unicode canonical composition turns into one (Hangul L+V+T)."""

_GROWING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
"""Normalizers that never make text shorter."""
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})
"""Pre-tokenizers that split text without dropping any of it."""


def _normalizer_shrink(spec: dict[str, Any] | None) -> float | None:
    """How much shorter the normalizer can make text (1 = never), None = unbounded."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind in _GROWING_NORMALIZERS:
        return 1.0
    if kind in _COMPOSING_NORMALIZERS:
        return float(COMPOSITION_SHRINK)
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        if "String" not in pattern or not pattern["String"]:
            return None  # a regex may match runs of any length
        return max(1.0, len(pattern["String"]) / max(1, len(spec.get("content", ""))))
    if kind == "Sequence":
        total = 1.0
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, anything new: may drop characters


def _pre_tokenizer_keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind in _KEEPING_PRE_TOKENIZERS:
        return True
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(part) for part in spec.get("pretokenizers", []))
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, ...: drop separators


def chars_per_token_bound(tokenizer: Any) -> float | None:
    """Most characters one token of ``tokenizer`` can stand for (shrink included); None = no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow (Python) tokenizer: nothing to inspect
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None  # WordPiece/WordLevel/Unigram map a whole unknown word or run to one token
    if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None  # a run of unknown characters becomes one token
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
        return None
    entries = [*tokenizer.get_vocab(), *(t.get("content", "") for t in spec.get("added_tokens", []))]
    longest = max((len(entry) for entry in entries), default=0)
    return None if longest == 0 else longest * shrink


class TextLimit:
    """Refuses text longer than any prompt that fits ``max_model_len`` (see the module docstring)."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        bound = chars_per_token_bound(tokenizer)
        # More than this many characters means at least max_model_len tokens: no room for a completion.
        self.max_chars = None if bound is None else int((max_model_len - 1) * bound)
        self.max_model_len = max_model_len

    def check(self, num_chars: int, param: str) -> None:
        """``PromptTooLongError`` (400) when ``num_chars`` characters cannot fit the context."""
        if self.max_chars is not None and num_chars > self.max_chars:
            raise PromptTooLongError(
                f"The prompt has {num_chars} characters, more than a {self.max_model_len}-token context "
                f"can hold with this tokenizer.",
                param,
            )

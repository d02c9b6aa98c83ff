"""Incremental detokenization with stop strings. Pure Python.

Decoding uses the prefix/read offset technique (TGI, vLLM): each step decodes
a short window ``tokens[prefix_offset:]`` and emits what it adds over
``tokens[prefix_offset:read_offset]``. A window whose text ends in U+FFFD is
an incomplete UTF-8 character (byte-level BPE splits multi-byte characters
across tokens), so nothing is emitted until a later token completes it. A
token that adds no text at all (a special token skipped in the output) moves
the window on, as one that adds text does: otherwise a run of such tokens
would grow the window without end and make every step decode all of it
again (quadratic in the output). A window still incomplete after
``MAX_PENDING_TOKENS`` tokens (no UTF-8 character spans that many) is
emitted as it is.

The window covers output tokens only, so that for any tokenizer whose decode
is prefix-stable (byte-level BPE, Metaspace) the concatenated text equals
``tokenizer.decode(output_ids, skip_special_tokens=...)``; with prompt context
a Metaspace tokenizer would keep the first token's leading space.

With ``min_tokens`` the text of the first ``min_tokens`` tokens never holds a
stop: a stop string counts only when it ends in text decoded from a later
token (vLLM's rule). That text is held back as usual while it may begin a
stop string, and marked ``protected`` so that a later search skips matches
ending inside it.

Options (vLLM's): ``skip_special_tokens`` (default true) leaves special
tokens out of the text; ``spaces_between_special_tokens`` (default true) goes
to the tokenizer's ``decode`` when false (fast tokenizers ignore it, as
vLLM's detokenizer does); ``include_stop_str_in_output`` keeps the stop
string that ends the text (what follows it is dropped all the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
MAX_PENDING_TOKENS = 16
"""Tokens a window may hold back as an incomplete character before it is emitted anyway."""


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, honouring stop strings.

    ``prompt_token_ids`` is accepted for interface parity with the request but
    is not decoded (see the module docstring). After a stop string is found
    the detokenizer is ``stopped`` and returns no more text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        *,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        del prompt_token_ids  # see the class docstring
        self._stop = tuple(s for s in stop if s)
        self._decode_options: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # only when asked: the default call stays the tokenizer's own
            self._decode_options["spaces_between_special_tokens"] = False
        self._include_stop = include_stop_str_in_output
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._held = ""  # decoded text not emitted yet: it may begin a stop string
        self._num_protected = 0  # leading characters of _held no stop string may end in (min_tokens)
        self._min_tokens = min_tokens
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found."""
        return self._stopped

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids)

    def add_tokens(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Append sampled tokens; return ``(new_text, stopped)``.

        ``new_text`` may be empty (an incomplete character, or text held back
        because it may begin a stop string). When a stop string appears, the
        text before it is returned with ``stopped=True``.
        """
        if self._stopped:
            return "", True
        released = []
        for token_id in token_ids:
            self._token_ids.append(int(token_id))
            text = self._decode_step()
            if not self._stopped:
                released.append(self._release(text, final=False))
        return "".join(released), self._stopped

    def flush(self) -> str:
        """Return all remaining text (the request ended): held text and any
        trailing incomplete character, cut at a stop string if one appears."""
        if self._stopped:
            return ""
        tail = self._decode(self._token_ids[self._prefix_offset :])
        head = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return self._release(tail[len(head) :], final=True)

    def _decode_step(self) -> str:
        """Text added by the newest token, or "" while a character is incomplete."""
        head = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._token_ids[self._prefix_offset :])
        stuck = len(self._token_ids) - self._read_offset >= MAX_PENDING_TOKENS
        if full != head and (len(full) < len(head) or full.endswith(_REPLACEMENT_CHAR)) and not stuck:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full[len(head) :]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, **self._decode_options)

    def _release(self, text: str, *, final: bool) -> str:
        """Add ``text`` (decoded up to the newest token) to the held text; return what can no
        longer start a stop string. Within ``min_tokens`` all of it is protected."""
        held = self._held + text
        if not self._stop:
            self._held = ""
            return held
        if len(self._token_ids) <= self._min_tokens:
            protected = len(held)
        else:
            protected = self._num_protected
            hit = _first_stop(held, self._stop, protected)
            if hit is not None:
                start, stop = hit
                self._held = ""
                self._stopped = True
                return held[: start + len(stop)] if self._include_stop else held[:start]
        keep = 0 if final else _stop_prefix_len(held, self._stop)
        num_released = len(held) - keep
        self._held = held[num_released:]
        self._num_protected = max(0, protected - num_released)
        return held[:num_released]


def _first_stop(text: str, stop: tuple[str, ...], protected: int = 0) -> tuple[int, str] | None:
    """``(index, stop string)`` of the earliest occurrence of any stop string that ends after
    ``text[:protected]`` (the first listed among those at that index), or None."""
    hits = [(i, s) for s in stop if (i := text.find(s, max(0, protected - len(s) + 1))) >= 0]
    return min(hits, key=lambda hit: hit[0]) if hits else None


def _stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = max(len(s) for s in stop) - 1
    for n in range(min(longest, len(text)), 0, -1):
        suffix = text[-n:]
        if any(s.startswith(suffix) for s in stop):
            return n
    return 0

"""Multimodal rotary positions (Qwen2-VL's M-RoPE), computed once per request. Pure Python.

Models of the Qwen2-VL family rotate queries and keys by three position ids
per token (temporal, height, width) instead of one. The rule, the one
``transformers``' ``get_rope_index`` applies to a prompt:

- text tokens get the same id on all three axes, one more than the token before;
- an image whose LM grid is ``(t, h, w)`` tokens (row-major) starting where the
  next text position ``s`` would be gets ``(s + ti, s + hi, s + wi)`` for its
  token at grid cell ``(ti, hi, wi)``; the text after it continues at
  ``s + max(h, w)``, so positions grow slower than token indices;
- every token after the prompt (generated ones) sits at its index plus the
  request's rope delta ``max(prompt positions) + 1 - prompt length``.

KV slots stay sequential (slot = token index); only the rotary ids change, so
a token's positions depend only on the tokens and images before it (and on the
grid of the image it is in): chunked prefill, recompute after preemption and
prefix-cache hits (whose keys chain over earlier tokens and image hashes) all
see the same positions. Spans without a grid (LLaVA) are ordinary text here.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

Positions = tuple[list[int], list[int], list[int]]  # temporal, height, width ids, one per token


class GridSpan(Protocol):
    """What a plan needs of an image span (``request.MultiModalSpan`` is one)."""

    @property
    def offset(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def grid(self) -> tuple[int, int, int] | None: ...


@dataclass(frozen=True)
class _PlacedImage:
    offset: int  # index of its first token in the prompt
    end: int  # index after its last token
    grid: tuple[int, int, int]  # (t, h, w) in LM tokens; t * h * w == end - offset
    start: int  # position id of its top-left token on every axis
    shift_after: int  # position - index of the text that follows it


@dataclass(frozen=True)
class MRopePlan:
    """Where the positions of one request's tokens jump; ``positions()`` expands any range."""

    images: tuple[_PlacedImage, ...]
    num_prompt_tokens: int
    delta: int  # position - index of every generated token
    offsets: tuple[int, ...]  # images[i].offset, for bisection

    def positions(self, start: int, end: int) -> Positions:
        """The three position ids of tokens ``[start, end)`` (any range; generated tokens included)."""
        axes: Positions = ([], [], [])
        index = start
        k = bisect.bisect_right(self.offsets, index) - 1  # last image starting at or before index
        while index < end:
            if k >= 0 and index < self.images[k].end:
                index = self._image_positions(self.images[k], index, end, axes)
                continue
            stop = end
            if k + 1 < len(self.images):
                stop = min(stop, self.images[k + 1].offset)
            if index < self.num_prompt_tokens:
                stop = min(stop, self.num_prompt_tokens)
                shift = self.images[k].shift_after if k >= 0 else 0
            else:
                shift = self.delta
            ids = range(index + shift, stop + shift)
            for axis in axes:
                axis.extend(ids)
            index = stop
            if k + 1 < len(self.images) and index == self.images[k + 1].offset:
                k += 1
        return axes

    @staticmethod
    def _image_positions(image: _PlacedImage, index: int, end: int, axes: Positions) -> int:
        _, h, w = image.grid
        stop = min(end, image.end)
        for cell in range(index - image.offset, stop - image.offset):
            ti, rest = divmod(cell, h * w)
            hi, wi = divmod(rest, w)
            axes[0].append(image.start + ti)
            axes[1].append(image.start + hi)
            axes[2].append(image.start + wi)
        return stop


def build_plan(spans: Sequence[GridSpan], num_prompt_tokens: int) -> MRopePlan | None:
    """The plan of a prompt whose image spans carry LM grids; None when none does (1-D positions)."""
    placed: list[_PlacedImage] = []
    shift = 0  # position - index of the text before the next image
    for span in spans:
        if span.grid is None:
            continue
        t, h, w = span.grid
        if t * h * w != span.num_tokens or min(t, h, w) <= 0:
            raise ValueError("an image's grid does not match its token count")
        start = span.offset + shift
        shift = start + max(h, w) - span.end
        placed.append(_PlacedImage(span.offset, span.end, (t, h, w), start, shift))
    if not placed:
        return None
    # Text before an image sits below the image's start, so the largest position
    # is an image's or that of the text after the last image.
    last = placed[-1]
    text_after = num_prompt_tokens - 1 + last.shift_after if num_prompt_tokens > last.end else -1
    image_max = max(image.start + max(image.grid) - 1 for image in placed)
    delta = max(text_after, image_max) + 1 - num_prompt_tokens
    return MRopePlan(tuple(placed), num_prompt_tokens, delta, tuple(image.offset for image in placed))

"""Multimodal rotary positions (Qwen2-VL's M-RoPE), computed once per request. Pure Python.

Models of the Qwen2-VL family rotate queries and keys by three position ids
per token (temporal, height, width) instead of one. The rule, the one
``transformers``' ``get_rope_index`` applies to a prompt:

- text tokens get the same id on all three axes, one more than the token before;
- an image whose LM grid is ``(t, h, w)`` tokens (row-major) starting where the
  next text position ``s`` would be gets ``(s + ti, s + hi, s + wi)`` for its
  token at grid cell ``(ti, hi, wi)``; the text after it continues at
  ``s + max(h, w)``, so positions grow slower than token indices;
- a video is an image with ``t > 1`` whose temporal ids are spaced by its
  span's ``time_step`` (Qwen2.5-VL: ``tokens_per_second * second_per_grid_t``;
  1 otherwise): ``s + int(ti * time_step)``, in float32 as transformers
  computes it; the text after it still continues at ``s + max(h, w)``;
- a video whose temporal patches text separates (``frame_offsets``: Qwen3-VL's
  timestamps) is, patch by patch, an image of grid ``(1, h, w)``: Qwen3-VL's
  ``get_rope_index`` splits its grid the same way;
- every token after the prompt (generated ones) sits at its index plus the
  request's rope delta: it continues from the last prompt token's position
  (transformers' ``generate()`` adds 1 per step to it), which for a prompt
  ending in text is ``max(prompt positions) + 1 - prompt length`` unless a
  video's time axis runs past the text after it; a prompt ending in an image
  continues after its largest position.

KV slots stay sequential (slot = token index); only the rotary ids change, so
a token's positions depend only on the tokens and images before it (and on the
grid of the image it is in): chunked prefill, recompute after preemption and
prefix-cache hits (whose keys chain over earlier tokens and image hashes) all
see the same positions. Spans without a grid (LLaVA) are ordinary text here.
"""

from __future__ import annotations

import bisect
import struct
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
    @property
    def time_step(self) -> float: ...
    @property
    def frame_offsets(self) -> tuple[int, ...]: ...


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def temporal_offset(ti: int, time_step: float) -> int:
    """The temporal id of grid frame ``ti`` above the item's start: transformers'
    ``(arange(t) * time_interval).long()``, a float32 product truncated."""
    if time_step == 1.0:
        return ti
    return int(_float32(ti * _float32(time_step)))


@dataclass(frozen=True)
class _PlacedImage:
    offset: int  # index of its first token in the prompt
    end: int  # index after its last token
    grid: tuple[int, int, int]  # (t, h, w) in LM tokens; t * h * w == end - offset
    start: int  # position id of its top-left token on every axis
    shift_after: int  # position - index of the text that follows it
    time_step: float = 1.0  # temporal id spacing (videos)

    @property
    def max_position(self) -> int:
        t, h, w = self.grid
        return self.start + max(max(h, w) - 1, temporal_offset(t - 1, self.time_step))


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
            axes[0].append(image.start + temporal_offset(ti, image.time_step))
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
        if span.frame_offsets and len(span.frame_offsets) != t:
            raise ValueError("a video needs one frame offset per temporal patch")
        # Each run of a video whose frames text separates is an image of one frame.
        runs = [(offset, 1) for offset in span.frame_offsets] or [(span.offset, t)]
        for offset, frames in runs:
            end = offset + frames * h * w
            start = offset + shift
            shift = start + max(h, w) - end
            placed.append(_PlacedImage(offset, end, (frames, h, w), start, shift, span.time_step))
    if not placed:
        return None
    # A prompt that ends in text continues from its last position (generate()'s rule); text before an image
    # sits below the image's start, so a prompt that ends in an image continues after that image's largest.
    last = placed[-1]
    if num_prompt_tokens > last.end:
        delta = last.shift_after
    else:
        delta = max(image.max_position for image in placed) + 1 - num_prompt_tokens
    return MRopePlan(tuple(placed), num_prompt_tokens, delta, tuple(image.offset for image in placed))

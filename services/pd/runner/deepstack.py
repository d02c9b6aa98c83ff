"""DeepStack features of one packed step (Qwen3-VL): what the LM adds after its first layers.

An image's embedding on PD is ``[num_tokens, 1 + levels, hidden]``: per token
the row that replaces the placeholder's embedding, then one row per level.
transformers' Qwen3-VL text model adds level ``i`` to the hidden states of the
visual positions after its layer ``i``, given ``visual_pos_masks`` (``[1, T]``)
and ``deepstack_visual_embeds`` (``levels`` tensors of ``[num_visual, hidden]``,
in position order): exactly what ``generate()`` does on a whole prompt,
position by position. A step's visual positions are the image slices of its
chunks (``ImageSlice``: a chunk may hold part of an image, a packed step the
chunks of several requests), so the features of each slice are the same rows
of the same embedding as its main rows, and positions that no slice covers
(text, decode rows) get nothing added.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DeepstackRows:
    """Collects a packed step's DeepStack rows slice by slice (``step_inputs.splice_image_rows``), then builds
    the keyword arguments of the LM's forward (``forward_kwargs``)."""

    def __init__(self, num_levels: int, num_tokens: int, device: torch.device) -> None:
        self.num_levels = num_levels
        self._mask = torch.zeros(num_tokens, dtype=torch.bool)  # built on the host: one copy at the end
        self._starts: list[int] = []
        self._rows: list[torch.Tensor] = []  # [length, levels, hidden] each, in packed order
        self._device = device

    def add(self, start: int, rows: torch.Tensor) -> None:
        """The features ``rows`` (``[length, levels, hidden]``) of packed positions ``[start, start + length)``."""
        if rows.dim() != 3 or rows.shape[1] != self.num_levels:
            raise ValueError("image slice does not carry this model's DeepStack levels")
        self._mask[start : start + rows.shape[0]] = True
        self._starts.append(start)
        self._rows.append(rows)

    def forward_kwargs(self, dtype: torch.dtype) -> dict[str, object]:
        """``visual_pos_masks`` and ``deepstack_visual_embeds`` for the LM; empty when no image is in the step."""
        if not self._rows:
            return {}
        order = sorted(range(len(self._starts)), key=self._starts.__getitem__)  # slices are packed in order
        rows = _cat([self._rows[i] for i in order]).to(self._device, dtype)  # [num_visual, levels, hidden]
        return {
            "visual_pos_masks": self._mask.to(self._device)[None],
            "deepstack_visual_embeds": list(rows.unbind(1)),
        }


def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))

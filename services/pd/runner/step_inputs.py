"""What a step feeds the model besides its token ids: rotary positions, and image rows in the packed batch.

``step_position_ids`` is the one place position ids are made, for both paths
of ``model_runner`` (packed steps, and the static buffers of decode-only
steps). ``splice_image_rows`` writes each image slice's embedding rows over
its placeholder tokens in a packed step's token embeddings, handing the
slice's DeepStack feature rows to ``deepstack.DeepstackRows``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from services.pd.engine.outputs import ScheduledChunk
from services.pd.runner.deepstack import DeepstackRows


def step_position_ids(chunks: Sequence[ScheduledChunk], mrope: bool = False) -> list[list[int]]:
    """The rotary positions of every token of a step, in packed order: one row, or three (t, h, w).

    The one place position ids are made: a chunk's tokens sit at
    ``start_pos, start_pos + 1, ...``; with multimodal RoPE a chunk with a
    plan (``positions.py``) takes its three rows from it, text-only chunks
    repeat the token index on every axis. (KV slots follow ``start_pos``
    too, but are the attention metadata's business, not the model's.)
    """
    if not mrope:
        return [[p for chunk in chunks for p in range(chunk.start_pos, chunk.start_pos + chunk.num_tokens)]]
    axes: list[list[int]] = [[], [], []]
    for chunk in chunks:
        start, end = chunk.start_pos, chunk.start_pos + chunk.num_tokens
        rows = [range(start, end)] * 3 if chunk.rope is None else chunk.rope.positions(start, end)
        for axis, ids in zip(axes, rows):
            axis.extend(ids)
    return axes


def splice_image_rows(
    embeds: torch.Tensor,
    chunks: Sequence[ScheduledChunk],
    embeddings: Mapping[str, torch.Tensor],
    deepstack: DeepstackRows | None = None,
) -> torch.Tensor:
    """The packed batch's token embeddings ``embeds`` (``[T, hidden]``, written in place) with image rows
    spliced in, as ``[1, T, hidden]``; each image slice's DeepStack rows go to ``deepstack`` (a model with
    DeepStack features)."""
    row = 0
    for chunk in chunks:
        for image in chunk.image_slices:
            if image.dst_start < 0 or image.dst_start + image.length > chunk.num_tokens:
                raise ValueError("image slice falls outside its chunk")
            source = embeddings.get(image.mm_hash)
            if source is None:
                raise KeyError("no embedding for an image scheduled in this step")
            rows = source[image.src_start : image.src_start + image.length]
            shape_ok = rows.shape[0] == image.length and rows.shape[-1] == embeds.shape[1]
            if image.src_start < 0 or not shape_ok or (rows.dim() == 3) != (deepstack is not None):
                raise ValueError("image slice does not match its embedding's shape")
            start = row + image.dst_start
            if deepstack is not None:
                deepstack.add(start, rows[:, 1:])  # [length, levels, hidden]
                rows = rows[:, 0]
            embeds[start : start + image.length] = rows.to(embeds.device, embeds.dtype, non_blocking=True)
        row += chunk.num_tokens
    return embeds[None]

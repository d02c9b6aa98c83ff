"""Placeholder expansion: each image or video token of a rendered prompt becomes its item's span.

The chat template writes one image (or video) token per item; PD expects
``num_tokens`` copies of it at the item's offset (``preprocess.Prompt``).
These functions do the expansion and report where each span starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from services.proxy.errors import PlaceholderMismatchError


def expand_placeholders(
    token_ids: Sequence[int], image_token_id: int, counts: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Replaces the i-th image token with ``counts[i]`` copies of it.

    Returns ``(expanded_ids, offsets)`` where ``offsets[i]`` is the index of
    the i-th image's first placeholder in ``expanded_ids``. The number of
    image tokens in ``token_ids`` must equal ``len(counts)``: an extra one
    means the text itself contained the image token.
    """
    expanded, offsets = expand_media(token_ids, {image_token_id: counts})
    return expanded, offsets[image_token_id]


def expand_media(
    token_ids: Sequence[int], placeholders: Mapping[int, Sequence[int]]
) -> tuple[list[int], dict[int, list[int]]]:
    """``expand_placeholders`` for several placeholder ids at once (images and videos): each id's i-th
    occurrence becomes ``placeholders[id][i]`` copies; returns the ids and each placeholder's offsets."""
    runs = {token: [[PlaceholderRun((), count, ())] for count in counts] for token, counts in placeholders.items()}
    expanded, offsets = expand_runs(token_ids, runs)
    return expanded, {token: [item[0] for item in items] for token, items in offsets.items()}


class PlaceholderRun(NamedTuple):
    """One run of a placeholder's expansion: token ids before it, how many copies of the placeholder, ids after."""

    before: Sequence[int]
    num_tokens: int
    after: Sequence[int]


def expand_runs(
    token_ids: Sequence[int], placeholders: Mapping[int, Sequence[Sequence[PlaceholderRun]]]
) -> tuple[list[int], dict[int, list[list[int]]]]:
    """``expand_media`` where an item may expand to several runs of its placeholder with text around
    each (a Qwen3-VL video: a timestamp and vision markers per temporal patch): each id's i-th occurrence
    becomes ``placeholders[id][i]``'s runs in order; returns the ids and, per item, where its runs start."""
    found = [token for token in token_ids if token in placeholders]
    for token, items in placeholders.items():
        if found.count(token) != len(items):
            raise PlaceholderMismatchError(
                f"The prompt has {found.count(token)} placeholders for {len(items)} images or videos; "
                "text must not contain the image or video token.",
                "messages",
            )
    pending = {token: iter(items) for token, items in placeholders.items()}
    offsets: dict[int, list[list[int]]] = {token: [] for token in placeholders}
    expanded: list[int] = []
    for token in token_ids:
        if token not in pending:
            expanded.append(token)
            continue
        starts = []
        for run in next(pending[token]):
            if run.num_tokens <= 0:
                raise ValueError("every image must expand to at least one token")
            expanded.extend(run.before)
            starts.append(len(expanded))
            expanded.extend([token] * run.num_tokens)
            expanded.extend(run.after)
        offsets[token].append(starts)
    return expanded, offsets

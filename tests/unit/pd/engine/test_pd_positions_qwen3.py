"""Qwen3-VL's prompts on PD: videos whose temporal patches text separates, against transformers.

A Qwen3-VL video is one item (one embedding, one reservation) whose rows go
to several runs of the prompt (``frame_offsets``): its positions equal
transformers' ``Qwen3VLModel.get_rope_index`` in any chunking, a chunk gets the
right rows of the right runs (``image_slices``), and the runs are part of the
prefix-cache key.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from services.common.pb import epd_pb2
from services.pd.convert import spans_from_pb
from services.pd.engine.errors import EngineError
from services.pd.engine.kv_cache import KVCacheManager
from services.pd.engine.positions import build_plan
from services.pd.engine.request import MultiModalSpan, Request, SamplingParams
from services.pd.engine.spans import image_slices

IMAGE, VIDEO, START, END = 7, 8, 9, 10
MERGE = 2
HASH = "ab" * 32


@pytest.fixture(scope="module")
def reference() -> Qwen3VLModel:
    """``get_rope_index`` of a weightless Qwen3-VL."""
    config = Qwen3VLConfig(
        text_config=dict(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=16,
            vocab_size=32,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(depth=1, hidden_size=8, intermediate_size=8, num_heads=1, patch_size=4, out_hidden_size=16),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
    )
    with torch.device("meta"):
        return Qwen3VLModel(config)


def _prompt(rng: random.Random) -> tuple[list[int], list[MultiModalSpan], list[tuple], list[tuple]]:
    """Text, images and videos as Qwen3-VL's processor writes them: a video's temporal patches each
    after a timestamp (a few text tokens) and between vision markers."""
    ids, spans, image_grids, video_grids = [], [], [], []
    for _ in range(rng.randint(1, 4)):
        ids += [1] * rng.randint(1, 4) + [START]
        t, h, w = rng.randint(2, 5), rng.randint(1, 4), rng.randint(1, 4)
        if rng.random() < 0.5:
            spans.append(MultiModalSpan(HASH, len(ids), h * w, (1, h, w)))
            image_grids.append((1, h * MERGE, w * MERGE))
            ids += [IMAGE] * (h * w)
        else:
            offsets = []
            for _ in range(t):
                ids += [2] * rng.randint(3, 6) + [START]  # "<1.5 seconds>" and the marker
                offsets.append(len(ids))
                ids += [VIDEO] * (h * w) + [END]
            spans.append(MultiModalSpan(HASH, offsets[0], t * h * w, (t, h, w), frame_offsets=tuple(offsets)))
            video_grids.append((t, h * MERGE, w * MERGE))
        ids += [END]
    ids += [1] * rng.randint(1, 4)
    return ids, spans, image_grids, video_grids


def test_videos_split_by_timestamps_equal_get_rope_index_in_any_chunking(reference):
    rng = random.Random(31)
    for trial in range(30):
        ids, spans, image_grids, video_grids = _prompt(rng)
        input_ids = torch.tensor([ids])
        types = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
        want, delta = reference.get_rope_index(
            input_ids,
            types,
            image_grid_thw=torch.tensor(image_grids) if image_grids else None,
            video_grid_thw=torch.tensor(video_grids) if video_grids else None,
        )
        plan = build_plan(spans, len(ids))
        total = len(ids) + 3
        cuts = sorted({0, total, *rng.sample(range(1, total), 4)})
        axes: tuple[list[int], list[int], list[int]] = ([], [], [])
        for start, end in zip(cuts, cuts[1:]):
            for axis, part in zip(axes, plan.positions(start, end)):
                axis.extend(part)
        assert torch.equal(torch.tensor(axes)[:, : len(ids)], want[:, 0]), f"trial {trial}"
        assert plan.delta == int(delta[0, 0])
        generated = torch.arange(len(ids), total) + plan.delta
        assert torch.equal(torch.tensor(axes)[:, len(ids) :], generated.expand(3, -1))


def test_a_chunk_gets_the_rows_of_the_runs_it_covers():
    # Two frames of 4 rows at 10 and 20 (text between them): rows 0-3 go to 10-13, rows 4-7 to 20-23.
    video = MultiModalSpan(HASH, 10, 8, (2, 2, 2), frame_offsets=(10, 20))
    assert video.end == 24 and [tuple(run) for run in video.runs()] == [(10, 0, 4), (20, 4, 4)]
    slices = image_slices([video], 12, 22)  # the chunk [12, 22) ends inside the second run
    assert [(s.src_start, s.dst_start, s.length) for s in slices] == [(2, 0, 2), (4, 8, 2)]
    assert image_slices([video], 14, 20) == []  # only the text between the runs
    whole = image_slices([video], 0, 30)
    assert sum(s.length for s in whole) == 8 and [s.dst_start for s in whole] == [10, 20]


def test_frame_offsets_are_part_of_the_prefix_cache_key():
    def keys(frame_offsets: tuple[int, ...]) -> list[bytes]:
        span = MultiModalSpan(HASH, 2, 8, (2, 2, 2), frame_offsets=frame_offsets)
        request = Request("r", [1] * 40, SamplingParams(), mm_spans=[span])
        manager = KVCacheManager(num_blocks=8, block_size=16)
        return manager._block_keys_of(request, 2)

    assert keys((2, 12)) != keys((2, 14))  # the same video's rows elsewhere: other K/V
    assert keys((2, 12)) == keys((2, 12))


def _item(**fields) -> epd_pb2.MultiModalItem:
    item = epd_pb2.MultiModalItem(mm_hash=HASH, offset=4, num_tokens=8, **fields)
    item.grid.t, item.grid.h, item.grid.w = 2, 2, 2
    return item


def test_frame_offsets_are_checked_where_they_arrive():
    spans = spans_from_pb([_item(frame_offsets=[4, 12])], 30, uses_grids=True)
    assert spans[0].frame_offsets == (4, 12) and spans[0].end == 16
    for bad in ([4], [5, 12], [4, 6], [4, 12, 20]):  # one per frame, the first at offset, no overlap
        with pytest.raises(EngineError, match="frame_offsets"):
            spans_from_pb([_item(frame_offsets=bad)], 30, uses_grids=True)
    with pytest.raises(EngineError, match="past the prompt"):
        spans_from_pb([_item(frame_offsets=[4, 26])], 28, uses_grids=True)

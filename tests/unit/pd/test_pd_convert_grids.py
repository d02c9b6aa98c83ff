"""PD's side of the grid contract: validated items, positions planned once per request."""

from __future__ import annotations

import pytest
import torch

from services.common import tensors
from services.common.models.vision_io import PixelLayout
from services.common.pb import epd_pb2
from services.pd.colocated import parse_encode_request
from services.pd.convert import request_from_pb, spans_from_pb
from services.pd.engine.errors import EngineError, ErrorKind

HASH = "ef" * 32


def _item(offset: int, num_tokens: int, grid=None) -> epd_pb2.MultiModalItem:
    item = epd_pb2.MultiModalItem(mm_hash=HASH, offset=offset, num_tokens=num_tokens)
    if grid is not None:
        item.grid.CopyFrom(epd_pb2.ImageGrid(t=grid[0], h=grid[1], w=grid[2]))
    return item


def test_grids_become_span_grids_and_plan_positions():
    message = epd_pb2.GenerateRequest(
        request_id="r",
        prompt_token_ids=[1, 2] + [7] * 6 + [3],
        mm_items=[_item(2, 6, (1, 2, 3))],
        sampling=epd_pb2.SamplingParams(max_tokens=2),
    )
    request = request_from_pb(message, eos_token_ids=(), vocab_size=10, max_model_len=64, uses_grids=True)
    assert request.mm_spans[0].grid == (1, 2, 3)
    assert request.rope_plan is not None and request.rope_plan.delta == -3
    assert request.rope_plan.positions(8, 10) == ([5, 6], [5, 6], [5, 6])  # text after it, then generated
    text = epd_pb2.GenerateRequest(request_id="t", prompt_token_ids=[1, 2], sampling=epd_pb2.SamplingParams())
    assert request_from_pb(text, eos_token_ids=(), vocab_size=10, max_model_len=64).rope_plan is None


@pytest.mark.parametrize(
    ("item", "uses_grids", "message"),
    [
        (_item(0, 6, (1, 2, 2)), None, "t\\*h\\*w must equal num_tokens"),
        (_item(0, 4, (0, 2, 2)), None, "positive"),
        (_item(0, 4), True, "needs image grids"),
        (_item(0, 4, (1, 2, 2)), False, "takes no image grids"),
    ],
)
def test_bad_grids_are_invalid_arguments(item, uses_grids, message):
    with pytest.raises(EngineError, match=message) as error:
        spans_from_pb([item], prompt_len=8, uses_grids=uses_grids)
    assert error.value.kind is ErrorKind.INVALID_ARGUMENT


def test_spans_without_grids_are_unchanged_for_fixed_size_models():
    [span] = spans_from_pb([_item(1, 4)], prompt_len=8, uses_grids=False)
    assert span.grid is None


def test_colocated_encode_checks_patches_against_the_tower():
    layout = PixelLayout(patch_dim=12, merge_size=2)
    good = epd_pb2.EncodeItem(
        mm_hash=HASH,
        reservation_id="x",
        pixel_values=tensors.to_pb(torch.zeros(8, 12)),
        grid=epd_pb2.ImageGrid(t=1, h=2, w=4),
    )
    [item] = parse_encode_request(epd_pb2.EncodeRequest(request_id="r", items=[good]), float("inf"), layout)
    assert item.grid == (1, 2, 4)
    bad = epd_pb2.EncodeItem(mm_hash=HASH, reservation_id="x", pixel_values=tensors.to_pb(torch.zeros(8, 12)))
    with pytest.raises(EngineError, match="grid is required for this model") as error:
        parse_encode_request(epd_pb2.EncodeRequest(request_id="r", items=[bad]), float("inf"), layout)
    assert error.value.kind is ErrorKind.INVALID_ARGUMENT


def test_a_video_item_gets_its_temporal_step_from_the_models_rate():
    item = _item(1, 12, (3, 2, 2))
    item.second_per_grid_t = 2 / 3  # float32 on the wire
    qwen25 = spans_from_pb([item], 16, uses_grids=True, tokens_per_second=2)
    assert qwen25[0].time_step == pytest.approx(4 / 3) and qwen25[0].time_step != 4 / 3  # a float32 product
    assert spans_from_pb([item], 16, uses_grids=True)[0].time_step == 1.0  # Qwen2-VL: one a patch
    assert spans_from_pb([_item(1, 12, (3, 2, 2))], 16, uses_grids=True, tokens_per_second=2)[0].time_step == 1.0


@pytest.mark.parametrize(
    ("seconds", "grid", "message"),
    [
        (0.0, (3, 2, 2), "second_per_grid_t must be in"),
        (float("nan"), (3, 2, 2), "second_per_grid_t must be in"),
        (1e9, (3, 2, 2), "second_per_grid_t must be in"),
        (1.0, None, "a video needs a grid"),
    ],
)
def test_bad_video_timing_is_refused(seconds, grid, message):
    item = _item(1, 12, grid)
    item.second_per_grid_t = seconds
    with pytest.raises(EngineError, match=message) as raised:
        spans_from_pb([item], 16, tokens_per_second=2)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT

"""The pure-Python M-RoPE rule against transformers' own ``get_rope_index``, on many layouts."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from services.common.pb import epd_pb2
from services.pd.convert import video_time_step
from services.pd.engine.positions import build_plan
from services.pd.engine.request import MultiModalSpan, Request, SamplingParams, rope_plan

IMAGE = 7
VIDEO = 8
MERGE = 2
TOKENS_PER_SECOND = 4
HASH = "ab" * 32


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def reference(request):
    """``get_rope_index`` of a (weightless) model of each family."""
    text = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        vocab_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [1, 1, 2]},
    )
    vision = dict(depth=1, num_heads=1, patch_size=4, spatial_merge_size=MERGE, temporal_patch_size=2)
    if request.param == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(
            text_config=text,
            vision_config=dict(
                vision, hidden_size=8, out_hidden_size=16, intermediate_size=8, fullatt_block_indexes=[0]
            ),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
        )
        config.vision_config.tokens_per_second = TOKENS_PER_SECOND
        model_class = Qwen2_5_VLModel
    else:
        config = Qwen2VLConfig(
            text_config=text,
            vision_config=dict(vision, embed_dim=8, hidden_size=16),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
        )
        model_class = Qwen2VLModel
    with torch.device("meta"):
        model = model_class(config)
    return model


def _layout(rng: random.Random, num_images: int) -> tuple[list[int], list[MultiModalSpan], list[tuple]]:
    """A prompt of text runs and images (never adjacent, as a chat template writes them)."""
    ids, spans, patch_grids = [], [], []
    for _ in range(num_images):
        ids += [1] * rng.randint(1, 6)
        t, h, w = 1, rng.randint(1, 7), rng.randint(1, 7)
        spans.append(MultiModalSpan(HASH, len(ids), t * h * w, (t, h, w)))
        patch_grids.append((t, h * MERGE, w * MERGE))
        ids += [IMAGE] * (t * h * w)
    ids += [1] * rng.randint(0, 5) if num_images else [1] * rng.randint(1, 9)
    return ids or [1], spans, patch_grids


def _hf_positions(model, ids: list[int], patch_grids: list[tuple]) -> tuple[torch.Tensor, int]:
    input_ids = torch.tensor([ids])
    token_types = (input_ids == IMAGE).int()
    positions, deltas = model.get_rope_index(input_ids, token_types, image_grid_thw=torch.tensor(patch_grids))
    return positions[:, 0], int(deltas[0, 0])


LAYOUTS = {
    "one_image_middle": ([1, 1, 1] + [IMAGE] * 6 + [1, 1], [(3, 6, (1, 2, 3))]),
    "image_first": ([IMAGE] * 4 + [1, 1, 1], [(0, 4, (1, 2, 2))]),
    "image_last": ([1, 1] + [IMAGE] * 12, [(2, 12, (1, 3, 4))]),
    "wide_tall_square": (
        [1] * 4 + [IMAGE] * 8 + [1] * 2 + [IMAGE] * 10 + [1] + [IMAGE] * 9 + [1] * 3,
        [(4, 8, (1, 1, 8)), (14, 10, (1, 5, 2)), (25, 9, (1, 3, 3))],
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fixed_layouts_equal_get_rope_index(reference, name):
    ids, raw = LAYOUTS[name]
    spans = [MultiModalSpan(HASH, offset, count, grid) for offset, count, grid in raw]
    want, delta = _hf_positions(reference, ids, [(t, h * MERGE, w * MERGE) for _, _, (t, h, w) in raw])
    plan = build_plan(spans, len(ids))
    assert torch.equal(torch.tensor(plan.positions(0, len(ids))), want)
    assert plan.delta == delta


def test_random_layouts_equal_get_rope_index_in_any_chunking(reference):
    rng = random.Random(15)
    for trial in range(40):
        ids, spans, patch_grids = _layout(rng, trial % 5)
        num_generated = 4
        if not spans:
            assert build_plan(spans, len(ids)) is None  # text only: 1-D positions, delta 0
            continue
        want, delta = _hf_positions(reference, ids, patch_grids)
        plan = build_plan(spans, len(ids))
        total = len(ids) + num_generated
        # Any chunking (chunked prefill, a prefix-cache hit, a decode step) gives the same ids.
        cuts = sorted({0, total, *rng.sample(range(1, total), min(4, total - 1))})
        axes = ([], [], [])
        for start, end in zip(cuts, cuts[1:]):
            for axis, part in zip(axes, plan.positions(start, end)):
                axis.extend(part)
        assert torch.equal(torch.tensor(axes)[:, : len(ids)], want), f"trial {trial}"
        assert plan.delta == delta
        generated = torch.arange(len(ids), total) + delta  # transformers: cache position + rope delta
        assert torch.equal(torch.tensor(axes)[:, len(ids) :], generated.expand(3, -1))


def test_positions_of_a_prefix_depend_only_on_the_prefix():
    # The prefix cache shares KV by a key over earlier tokens and image hashes:
    # the positions of a prefix must not depend on what follows it.
    rng = random.Random(3)
    for _ in range(20):
        ids, spans, _ = _layout(rng, 3)
        full = build_plan(spans, len(ids))
        cut = spans[1].end + 1  # a prefix that holds two whole images
        prefix = build_plan(spans[:2], cut)
        assert prefix.positions(0, cut) == full.positions(0, cut)


def test_plan_is_computed_once_and_kept_on_the_request():
    request = Request("r", [1, 1] + [IMAGE] * 4, SamplingParams(), mm_spans=[MultiModalSpan(HASH, 2, 4, (1, 2, 2))])
    plan = rope_plan(request)
    assert plan is not None and rope_plan(request) is plan and request.rope_plan is plan
    gridless = Request("s", [1, IMAGE, IMAGE], SamplingParams(), mm_spans=[MultiModalSpan(HASH, 1, 2)])
    assert rope_plan(gridless) is None  # LLaVA: positions are the token indices


def test_a_grid_that_does_not_match_its_span_is_refused():
    with pytest.raises(ValueError, match="grid"):
        build_plan([MultiModalSpan(HASH, 0, 5, (1, 2, 2))], 6)


def _video_step(model, second_per_grid_t: float) -> float:
    """What PD's convert makes of a video's seconds per patch for this family (convert._time_step)."""
    rate = TOKENS_PER_SECOND if isinstance(model, Qwen2_5_VLModel) else None
    item = epd_pb2.MultiModalItem(second_per_grid_t=second_per_grid_t)
    return video_time_step(item, 0, (1, 1, 1), rate)


@pytest.mark.parametrize("second_per_grid_t", [1.0, 0.5, 2 / 3, 0.4, 7.3])
def test_videos_and_images_equal_get_rope_index(reference, second_per_grid_t):
    """Videos (t > 1, temporal ids spaced by tokens_per_second * second_per_grid_t on Qwen2.5-VL) between
    images; text after a long video continues below its last temporal id, as transformers has it, and
    generated tokens continue from the last prompt token, as generate() steps them (get_rope_index's own
    delta, from the largest position, is another number when a video's time axis outruns the text)."""
    rng = random.Random(int(second_per_grid_t * 1000))
    for trial in range(12):
        ids, spans, image_grids, video_grids, seconds = [], [], [], [], []
        for k in range(rng.randint(1, 4)):
            ids += [1] * rng.randint(1, 5)
            is_video = k % 2 == 0 or rng.random() < 0.5
            t = rng.randint(2, 9) if is_video else 1
            h, w = rng.randint(1, 5), rng.randint(1, 5)
            step = _video_step(reference, second_per_grid_t) if is_video else 1.0
            spans.append(MultiModalSpan(HASH, len(ids), t * h * w, (t, h, w), step))
            (video_grids if is_video else image_grids).append((t, h * MERGE, w * MERGE))
            if is_video:
                seconds.append(second_per_grid_t)
            ids += [VIDEO if is_video else IMAGE] * (t * h * w)
        ids += [1] * rng.randint(1, 4)  # a chat prompt ends in text (the generation prompt)
        input_ids = torch.tensor([ids])
        types = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
        kwargs = dict(
            image_grid_thw=torch.tensor(image_grids) if image_grids else None,
            video_grid_thw=torch.tensor(video_grids),
        )
        if isinstance(reference, Qwen2_5_VLModel):
            kwargs["second_per_grid_ts"] = torch.tensor(seconds)  # float32, as the processor makes it
        want, _ = reference.get_rope_index(input_ids, types, **kwargs)
        plan = build_plan(spans, len(ids))
        assert torch.equal(torch.tensor(plan.positions(0, len(ids))), want[:, 0]), f"trial {trial}"
        # generate(): each new token's ids are the previous token's plus one, on every axis.
        assert plan.positions(len(ids), len(ids) + 3) == tuple(
            [int(want[0, 0, -1]) + k for k in (1, 2, 3)] for _ in range(3)
        )

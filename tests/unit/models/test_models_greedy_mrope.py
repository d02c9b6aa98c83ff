"""Greedy robustness of the built Qwen checkpoints, with the split halves and our M-RoPE positions.

Qwen3-VL's halves add the DeepStack features at the image positions, and
dropping them must change the greedy text too.

As ``test_models_greedy.py`` does for LLaVA: random prompts with 0-3 images
of different grids go through ``generate()`` on the full model, and through
the split halves in one right-padded batch with 3-D positions from
``services.pd.engine.positions``. The top-2 logit gap must dwarf their numerical
difference (so the engine's batched math agrees token for token), and both
the images and their positions must change the greedy text (so an oracle test
catches a wrong position or a wrong embedding).
"""

from __future__ import annotations

import random

import pytest
import torch
from oracle_support import make_image, user_message

from services.common.models import encode_images, load_adapter
from services.pd.engine.positions import build_plan
from services.pd.engine.request import MultiModalSpan

NUM_PROMPTS = 16
# Qwen3-VL's presets share Qwen2.5-VL's LM shape and gain: half the prompts keep the suite's time.
NUM_PROMPTS_BY_PRESET = {"qwen3-vl-tiny": 8, "qwen3-vl-moe-tiny": 8}
NEW_TOKENS = 8
CPU = torch.device("cpu")
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "red",
    "blue",
    "image",
    "describe",
    "what",
    "where",
    "when",
    "left",
    "right",
    "top",
]


def _cases(seed: int, num_prompts: int = NUM_PROMPTS) -> list[tuple[list[dict], list]]:
    rng = random.Random(seed)
    cases = []
    for i in range(num_prompts):
        images = [
            make_image(100 + 3 * i + k, (rng.choice([32, 48, 64, 96]), rng.choice([24, 48, 80]))) for k in range(i % 4)
        ]
        cases.append(([user_message(" ".join(rng.choices(WORDS, k=rng.randint(2, 12))), images)], images))
    return cases


def _spans(sequence: torch.Tensor, image_token_id: int, token_grids: list[tuple[int, int, int]]):
    """The image spans of a prompt (runs of image tokens, in order) with their LM grids."""
    spans, index, ids = [], 0, sequence.tolist()
    for grid in token_grids:
        start = ids.index(image_token_id, index)
        count = grid[0] * grid[1] * grid[2]
        spans.append(MultiModalSpan("0" * 64, start, count, grid))
        index = start + count
    return spans


def _split_half_logits(adapter, oracle, cases, sequences, mrope: bool, deepstack: bool = True) -> list[torch.Tensor]:
    """Logits of the split halves over all prompts in one right-padded batch; Qwen3-VL's DeepStack
    features added at the image positions unless ``deepstack`` is False."""
    lm = adapter.load_language_model(CPU, torch.float32)
    vision = adapter.load_vision(CPU, torch.float32)
    merge = adapter.merge_size
    length = max(len(s) for s in sequences)
    embeds = torch.zeros(len(sequences), length, adapter.hidden_size)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    positions = torch.zeros(3, len(sequences), length, dtype=torch.long)
    visual = torch.zeros(len(sequences), length, dtype=torch.bool)
    features = []  # per image row, [levels, hidden], in (row, position) order
    with torch.no_grad():
        for row, ((messages, images), sequence) in enumerate(zip(cases, sequences)):
            rows = lm.model.embed_tokens(sequence)
            token_grids = []
            if images:
                inputs = oracle.inputs(messages, images)
                grids = [tuple(int(n) for n in g) for g in inputs["image_grid_thw"]]
                pixels = inputs["pixel_values"].split([t * h * w for t, h, w in grids])
                encoded = torch.cat(encode_images(vision, list(zip(pixels, grids)), CPU, torch.float32))
                if encoded.dim() == 3:  # [tokens, 1 + levels, hidden]
                    features.append(encoded[:, 1:])
                    encoded = encoded[:, 0]
                    visual[row, : len(sequence)] = sequence == adapter.image_token_id
                rows[sequence == adapter.image_token_id] = encoded
                token_grids = [(t, h // merge, w // merge) for t, h, w in grids]
            plan = build_plan(_spans(sequence, adapter.image_token_id, token_grids), len(sequence) - NEW_TOKENS)
            if plan is not None and mrope:
                positions[:, row, : len(sequence)] = torch.tensor(plan.positions(0, len(sequence)))
            else:
                positions[:, row, : len(sequence)] = torch.arange(len(sequence))
            embeds[row, : len(sequence)] = rows
            mask[row, : len(sequence)] = 1
        extra = {}
        if features and deepstack:
            stacked = torch.cat(features)  # [visual tokens, levels, hidden]
            extra = {"visual_pos_masks": visual, "deepstack_visual_embeds": list(stacked.unbind(1))}
        logits = lm(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, **extra).logits
    return [logits[row, len(s) - 1 - NEW_TOKENS : len(s) - 1] for row, s in enumerate(sequences)]


@pytest.mark.parametrize("preset", ["qwen2.5-vl-tiny", "qwen2-vl-tiny", "qwen3-vl-tiny", "qwen3-vl-moe-tiny"])
def test_greedy_choices_survive_batching_and_depend_on_positions(build_model, oracle_for, preset):
    adapter = load_adapter(build_model(preset))
    oracle = oracle_for(preset)
    cases = _cases(seed=7, num_prompts=NUM_PROMPTS_BY_PRESET.get(preset, NUM_PROMPTS))
    reference = []
    for messages, images in cases:
        inputs = oracle.inputs(messages, images)
        out = oracle.model.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        reference.append((out.sequences[0], torch.cat(out.logits)))
    sequences = [sequence for sequence, _ in reference]
    batched = _split_half_logits(adapter, oracle, cases, sequences, mrope=True)

    max_diff = max((b - logits).abs().max().item() for b, (_, logits) in zip(batched, reference))
    top2 = torch.cat([logits for _, logits in reference]).topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    flips = sum(int((b.argmax(-1) != logits.argmax(-1)).sum()) for b, (_, logits) in zip(batched, reference))
    print(
        f"\n{preset}: steps={len(gaps)} min_gap={gaps.min():.4g} max_abs_logit_diff={max_diff:.3g} "
        f"ratio={gaps.min() / max(max_diff, 1e-12):.3g} flips={flips}"
    )
    assert flips == 0
    assert gaps.min() > 50 * max_diff

    # 1-D positions for the image prompts: the greedy text must change on some of them.
    flat = _split_half_logits(adapter, oracle, cases, sequences, mrope=False)
    changed = sum(
        bool((f.argmax(-1) != logits.argmax(-1)).any())
        for f, (_, logits), (_, images) in zip(flat, reference, cases)
        if images
    )
    print(f"{preset}: image prompts whose greedy text changes under 1-D positions: {changed}")
    assert changed >= 3
    if adapter.num_deepstack_levels:
        # Qwen3-VL: without the DeepStack features the greedy text must change on some image prompts too.
        bare = _split_half_logits(adapter, oracle, cases, sequences, mrope=True, deepstack=False)
        changed = sum(
            bool((f.argmax(-1) != logits.argmax(-1)).any())
            for f, (_, logits), (_, images) in zip(bare, reference, cases)
            if images
        )
        print(f"{preset}: image prompts whose greedy text changes without DeepStack features: {changed}")
        assert changed >= 3

"""Greedy robustness of the built weights (DESIGN §9).

The oracle compares the engine's greedy tokens (batched, padded float32 math on
the split halves) with ``generate()`` on the full model. This test does the
same on 50 random prompts, half with an image, and checks that the top-2 logit
gap dwarfs the numerical difference between the two paths, and that the text
is neither constant nor independent of its context.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from services.common.models import get_preset, load_adapter
from services.common.models.init_weights import successor_cycle

NUM_PROMPTS = 50
NEW_TOKENS = 8
CPU = torch.device("cpu")


def _prompts(vocab_size: int, special_ids: set[int], bos_id: int, image_token_id: int):
    """(input_ids, pixel_values or None) pairs; image prompts carry one image's placeholders."""
    rng = random.Random(1234)
    ordinary = [i for i in range(vocab_size) if i not in special_ids]
    preset = get_preset("tiny")
    size = preset.vision.image_size
    prompts = []
    for index in range(NUM_PROMPTS):
        ids = [bos_id] + rng.choices(ordinary, k=rng.randint(2, 40))
        pixel_values = None
        if index % 2:
            at = rng.randint(1, len(ids))
            ids[at:at] = [image_token_id] * preset.num_image_tokens
            generator = torch.Generator().manual_seed(index)
            pixel_values = torch.rand(1, 3, size, size, generator=generator) * 4 - 2
        prompts.append((torch.tensor([ids]), pixel_values))
    return prompts


def _generate(full, prompts, eos_token_id):
    """Oracle tokens and per-step logits [NEW_TOKENS, vocab] for each prompt."""
    outputs = []
    for input_ids, pixel_values in prompts:
        images = {} if pixel_values is None else {"pixel_values": pixel_values}
        out = full.generate(
            input_ids=input_ids,
            **images,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=eos_token_id,
        )
        outputs.append((out.sequences[0], torch.cat(out.logits)))
    return outputs


def _batched_logits(adapter, prompts, sequences) -> list[torch.Tensor]:
    """One right-padded batch through the split halves, as an engine would run it."""
    lm = adapter.load_language_model(CPU, torch.float32)
    encoder = adapter.load_vision(CPU, torch.float32)
    length = max(len(s) for s in sequences)
    embeds = torch.zeros(len(sequences), length, adapter.hidden_size)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    with torch.no_grad():
        for row, ((_, pixel_values), sequence) in enumerate(zip(prompts, sequences)):
            rows = lm.model.embed_tokens(sequence)
            if pixel_values is not None:
                rows[sequence == adapter.image_token_id] = encoder(pixel_values)[0]
            embeds[row, : len(sequence)] = rows
            mask[row, : len(sequence)] = 1
        logits = lm(inputs_embeds=embeds, attention_mask=mask).logits
    return [logits[row, len(s) - 1 - NEW_TOKENS : len(s) - 1] for row, s in enumerate(sequences)]


def test_greedy_choices_survive_batching(models_tiny_dir: Path, models_tiny_full):
    adapter = load_adapter(models_tiny_dir)
    tokenizer = adapter.load_tokenizer()
    special_ids = set(tokenizer.all_special_ids)
    prompts = _prompts(len(tokenizer), special_ids, tokenizer.bos_token_id, adapter.image_token_id)
    oracle = _generate(models_tiny_full, prompts, adapter.eos_token_id)
    batched = _batched_logits(adapter, prompts, [sequence for sequence, _ in oracle])

    max_diff = max((b - logits).abs().max().item() for b, (_, logits) in zip(batched, oracle))
    top2 = torch.cat([logits for _, logits in oracle]).topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    flips = sum(int((b.argmax(-1) != logits.argmax(-1)).sum()) for b, (_, logits) in zip(batched, oracle))
    print(
        f"\ngreedy: steps={len(gaps)} min_gap={gaps.min():.4g} median_gap={gaps.median():.4g} "
        f"max_abs_logit_diff={max_diff:.3g} ratio={gaps.min() / max(max_diff, 1e-12):.3g} flips={flips}"
    )
    assert flips == 0
    assert gaps.min() > 50 * max_diff

    generated = torch.stack([sequence[-NEW_TOKENS:] for sequence, _ in oracle])
    assert len(set(generated.flatten().tolist())) > NEW_TOKENS * NUM_PROMPTS // 2  # not one token forever
    assert not set(generated.flatten().tolist()) & special_ids  # never </s> or <image>
    successors = successor_cycle(len(tokenizer), special_ids, seed=0)
    previous = torch.stack([sequence[-NEW_TOKENS - 1 : -1] for sequence, _ in oracle])
    follows_bigram = torch.tensor(
        [[successors.get(int(p)) == int(g) for p, g in zip(*rows)] for rows in zip(previous, generated)]
    )
    context_share = 1 - follows_bigram.float().mean().item()
    print(f"greedy: share of tokens chosen by context rather than the bigram backbone={context_share:.2f}")
    assert context_share > 0.05

"""Sampler: greedy, temperature, top-k, top-p, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.pd.engine.request import SamplingParams
from services.pd.runner.sampler import Sampler, seeded_exponential, step_seed

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _ids(tokens) -> list[int]:
    return [t.token_id for t in tokens]


def _sampler() -> Sampler:
    return Sampler(generator=torch.Generator().manual_seed(1234))


def test_greedy_rows_are_argmax_even_mixed_with_random_rows():
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    out = _ids(_sampler().sample(logits, params, [0] * 6))
    assert out[0::2] == logits[0::2].argmax(dim=-1).tolist()


def test_top_k_one_and_tiny_temperature_equal_greedy():
    logits = _logits(8, seed=1)
    greedy = logits.argmax(dim=-1).tolist()
    top1 = [SamplingParams(temperature=1.5, top_k=1)] * 8
    cold = [SamplingParams(temperature=1e-4, seed=i) for i in range(8)]
    assert _ids(_sampler().sample(logits, top1, [0] * 8)) == greedy
    assert _ids(_sampler().sample(logits, cold, [0] * 8)) == greedy


def test_seeded_draws_do_not_depend_on_batch_composition():
    row = _logits(1, seed=2)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [_ids(_sampler().sample(row, [seeded], [n]))[0] for n in range(30)]
    crowd_logits = torch.cat([_logits(3, seed=3), row, _logits(2, seed=4)])
    crowd_params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=7),
        seeded,
        SamplingParams(top_p=0.5),
        SamplingParams(seed=42, top_k=3),
    ]
    in_crowd = [_ids(Sampler().sample(crowd_logits, crowd_params, [5, 0, n + 1, n, 2, 9]))[3] for n in range(30)]
    assert alone == in_crowd
    assert len(set(alone)) > 1  # the draw changes with the output position


def test_step_seed_separates_positions_and_seeds():
    seeds = {step_seed(s, n) for s in range(20) for n in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    sampler = _sampler()

    def support(params: SamplingParams, draws: int = 400) -> set[int]:
        batch = logits.expand(draws, -1)
        return set(_ids(sampler.sample(batch, [params] * draws, [0] * draws)))

    assert support(SamplingParams(top_k=2)) == {0, 1}
    assert support(SamplingParams(top_p=0.7)) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert support(SamplingParams(top_p=0.4)) == {0}
    assert support(SamplingParams(top_p=1e-9)) == {0}  # the top token always survives
    assert support(SamplingParams(top_p=0.0)) == {0}
    assert support(SamplingParams(top_p=0.9, top_k=2)) == {0, 1}
    assert support(SamplingParams(top_k=VOCAB + 10), draws=2000) == {0, 1, 2, 3}


def test_unseeded_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    draws = 6000
    logits = torch.full((draws, VOCAB), -1e9)
    logits[:, :3] = probs.log()
    out = torch.tensor(_ids(_sampler().sample(logits, [SamplingParams()] * draws, [0] * draws)))
    freq = torch.bincount(out, minlength=3)[:3].float() / draws
    assert torch.allclose(freq, probs, atol=0.03)


def test_logprobs_come_from_unmodified_logits():
    logits = _logits(3, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.3, top_k=2, seed=1, logprobs=0),
        SamplingParams(temperature=1.0, seed=2),
    ]
    out = _sampler().sample(logits, params, [0, 0, 0])
    reference = logits.log_softmax(dim=-1)
    first = out[0]
    assert len(first.top_token_ids) == len(first.top_logprobs) == 5
    assert list(first.top_token_ids) == reference[0].topk(5).indices.tolist()
    assert first.top_token_ids[0] == first.token_id
    assert first.logprob == pytest.approx(reference[0, first.token_id].item(), abs=1e-5)
    assert list(first.top_logprobs) == sorted(first.top_logprobs, reverse=True)
    second = out[1]
    assert second.logprob == pytest.approx(reference[1, second.token_id].item(), abs=1e-5)
    assert second.top_token_ids == () and second.top_logprobs == ()
    assert out[2].logprob is None and out[2].top_token_ids == ()


def test_full_vocab_logprobs_sum_to_one():
    out = _sampler().sample(_logits(1, seed=6), [SamplingParams(logprobs=VOCAB, seed=0)], [0])[0]
    assert len(out.top_logprobs) == VOCAB
    assert math.fsum(math.exp(lp) for lp in out.top_logprobs) == pytest.approx(1.0, abs=1e-5)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError):
        _sampler().sample(_logits(2), [SamplingParams()], [0, 0])


def test_seeded_noise_is_a_pure_function_of_key_and_token_id():
    keys = torch.tensor([step_seed(42, n) for n in range(4)])
    ids = torch.arange(VOCAB).expand(4, -1)
    noise = seeded_exponential(keys, ids)
    assert noise.shape == (4, VOCAB) and noise.dtype == torch.float32 and bool((noise > 0).all())
    shuffled = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    # The same token gets the same noise wherever it sits in the row and whichever rows come along.
    assert torch.equal(seeded_exponential(keys[2:3], shuffled[None]), noise[2:3, shuffled])
    assert len({tuple(row.tolist()) for row in noise}) == 4  # every output position draws anew


def test_seeded_noise_is_exponential():
    keys = torch.tensor([step_seed(seed, 0) for seed in range(64)])
    noise = seeded_exponential(keys, torch.arange(4096).expand(64, -1)).flatten().double()
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01)
    assert noise.var().item() == pytest.approx(1.0, abs=0.03)
    for x in (0.1, 0.5, 1.0, 2.0, 4.0):  # the CDF, 1 - exp(-x)
        assert (noise <= x).double().mean().item() == pytest.approx(1 - math.exp(-x), abs=0.005)


def test_seeded_frequencies_across_seeds_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    draws = 6000
    logits = torch.full((draws, VOCAB), -1e9)
    logits[:, :3] = probs.log()
    params = [SamplingParams(seed=seed) for seed in range(draws)]
    out = torch.tensor(_ids(_sampler().sample(logits, params, [0] * draws)))
    freq = torch.bincount(out, minlength=3)[:3].float() / draws
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_build_no_generator_and_upload_nothing_from_pageable_memory(monkeypatch):
    logits = _logits(6, seed=8)
    params = [SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=s, logprobs=2) for s in range(5)]
    params.append(SamplingParams(temperature=0.0))
    expected = _ids(Sampler().sample(logits, params, [3] * 6))
    real_tensor = torch.tensor

    def tensor_without_device(*args, **kwargs):
        # torch.tensor(..., device=cuda) copies from pageable memory and waits: uploads go through to_device.
        assert kwargs.get("device") is None, "a per-row setting was uploaded with a blocking copy"
        return real_tensor(*args, **kwargs)

    def no_generator(*args, **kwargs):
        raise AssertionError("a torch.Generator was built for a seeded row")

    monkeypatch.setattr(torch, "tensor", tensor_without_device)
    monkeypatch.setattr(torch, "Generator", no_generator)
    assert _ids(Sampler().sample(logits, params, [3] * 6)) == expected


def _hf_min_new_tokens(logits_row, prompt_len, num_output, min_tokens, stop_ids) -> torch.Tensor:
    """transformers' ``MinNewTokensLengthLogitsProcessor`` on one row (the oracle of the mask)."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    processor = MinNewTokensLengthLogitsProcessor(prompt_len, min_tokens, list(stop_ids))
    input_ids = torch.zeros(1, prompt_len + num_output, dtype=torch.long)
    return processor(input_ids, logits_row[None])[0]


def test_masked_token_ids_match_transformers_min_new_tokens():
    logits = _logits(5, seed=5)
    favourites = logits.argmax(dim=-1).tolist()
    # Rows 0, 2 and 4 are within min_tokens and mask their stop tokens (the row's argmax among them).
    rows = [
        (3, 0, (favourites[0], 11)),
        (3, 3, (favourites[1],)),
        (2, 1, (favourites[2],)),
        (0, 0, ()),
        (4, 2, (favourites[4], 1, 2)),
    ]
    masked = [ids if n < m else () for m, n, ids in rows]
    expected = torch.stack([_hf_min_new_tokens(logits[i], 7, n, m, ids or (0,)) for i, (m, n, ids) in enumerate(rows)])
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 5
    out = _sampler().sample(logits, params, [n for _, n, _ in rows], masked)
    assert _ids(out) == expected.argmax(dim=-1).tolist()
    assert [_ids(out)[i] == favourites[i] for i in range(5)] == [False, True, False, True, False]
    # logprobs stay those of the unmasked logits
    unmasked = logits.log_softmax(dim=-1)
    assert [t.logprob for t in out] == pytest.approx([unmasked[i, t.token_id].item() for i, t in enumerate(out)])


def test_random_rows_never_draw_a_masked_token():
    logits = torch.zeros(200, VOCAB)
    logits[:, :3] = 20.0  # nearly all mass on tokens 0..2
    params = [SamplingParams(temperature=1.0, seed=i if i % 2 else None) for i in range(200)]
    masked = [(0, 1) if i % 3 else () for i in range(200)]
    drawn = _ids(_sampler().sample(logits, params, [0] * 200, masked))
    assert all(t not in (0, 1) for t, m in zip(drawn, masked) if m)
    assert {t for t, m in zip(drawn, masked) if m} == {2}
    assert {t for t, m in zip(drawn, masked) if not m} >= {0, 1}


def test_masked_token_ids_need_one_entry_per_row():
    with pytest.raises(ValueError):
        _sampler().sample(_logits(2), [SamplingParams()] * 2, [0, 0], [()])

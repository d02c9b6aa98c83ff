"""min_p on fixed logits: against transformers' warpers, in vLLM's order with top-k / top-p, and at no cost when off."""

from __future__ import annotations

import pytest
import torch

from services.pd.engine.request import SamplingParams
from services.pd.runner import sampler as sampler_module
from services.pd.runner.sampler import Sampler, warp

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _unsorted(sorted_logits: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(sorted_logits).scatter_(1, sorted_ids, sorted_logits)


def _hf_warped(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order: temperature, top-k, min-p (no top-p here)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

    scores = logits_row[None].clone()
    input_ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(params.temperature)(input_ids, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
    if params.min_p > 0:
        scores = MinPLogitsWarper(params.min_p)(input_ids, scores)
    return scores[0]


PARAMS = [
    SamplingParams(min_p=0.05),
    SamplingParams(temperature=0.5, min_p=0.3),
    SamplingParams(temperature=2.0, min_p=0.4),
    SamplingParams(min_p=1.0),  # only the top token (and its exact ties)
    SamplingParams(min_p=0.0),  # off, in a batch where others use it
    SamplingParams(temperature=3.0, top_k=5, min_p=0.5),  # top-k commutes with min-p (which cuts deeper here)
]


def test_min_p_equals_transformers_min_p_warper():
    logits = _logits(len(PARAMS)) / 3  # flat enough that min_p keeps several tokens
    warped = _unsorted(*warp(logits, PARAMS))
    expected = torch.stack([_hf_warped(logits[i], p) for i, p in enumerate(PARAMS)])
    assert torch.equal(torch.isinf(warped), torch.isinf(expected))
    kept = ~torch.isinf(expected)
    assert torch.allclose(warped[kept], expected[kept])
    counts = kept.sum(dim=-1).tolist()
    assert all(1 < counts[i] < VOCAB for i in (0, 1, 2)) and counts[3] == 1 and counts[4] == VOCAB
    assert 1 < counts[5] < 5


def test_draws_stay_inside_the_min_p_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-6] * (VOCAB - 4)]))
    draws = 600
    batch = logits.expand(draws, -1)

    def support(params: SamplingParams) -> set[int]:
        tokens = Sampler(torch.Generator().manual_seed(0)).sample(batch, [params] * draws, [0] * draws)
        return {t.token_id for t in tokens}

    assert support(SamplingParams(min_p=0.25)) == {0, 1, 2}  # 0.15 >= 0.125 > 0.05
    assert support(SamplingParams(min_p=0.5)) == {0, 1}
    assert support(SamplingParams(min_p=1.0)) == {0}
    seeded = [SamplingParams(min_p=0.5, seed=s) for s in range(draws)]
    assert {t.token_id for t in Sampler().sample(batch, seeded, [0] * draws)} == {0, 1}


def test_top_p_comes_after_min_p_as_in_vllm():
    """min_p 0.25 keeps 3 tokens whose renormalised mass before the third is 0.84 > top_p 0.83: two stay.
    (transformers' order, top-p first, would keep three: 0.8 < 0.83.)"""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    sorted_logits, _ = warp(logits, [SamplingParams(min_p=0.25, top_p=0.83)])
    assert torch.isfinite(sorted_logits).sum().item() == 2


def test_min_p_leaves_greedy_rows_alone():
    logits = _logits(2, seed=1)
    params = [SamplingParams(temperature=0.0, min_p=1.0), SamplingParams(temperature=0.0)]
    assert [t.token_id for t in Sampler().sample(logits, params, [0, 0])] == logits.argmax(-1).tolist()


def test_without_min_p_no_filter_runs(monkeypatch):
    def no_min_p(*args, **kwargs):
        raise AssertionError("min_p filtered a batch where no row asks for it")

    monkeypatch.setattr(sampler_module, "_apply_min_p", no_min_p)
    params = [SamplingParams(seed=1), SamplingParams(top_k=5, top_p=0.9, seed=2)]
    assert len(Sampler().sample(_logits(2, seed=2), params, [0, 0])) == 2


@pytest.mark.parametrize("min_p", [0.0, 0.5, 1.0])
def test_min_p_keeps_the_top_token(min_p):
    logits = _logits(3, seed=3)
    sorted_logits, sorted_ids = warp(logits, [SamplingParams(min_p=min_p)] * 3)
    assert torch.isfinite(sorted_logits[:, 0]).all()
    assert torch.equal(sorted_ids[:, 0], logits.argmax(dim=-1))

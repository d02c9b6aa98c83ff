"""logit_bias on fixed logits: against transformers' SequenceBiasLogitsProcessor, its order, and no cost when unused."""

from __future__ import annotations

import pytest
import torch

from services.pd.engine.request import SamplingParams, TokenHistory
from services.pd.runner import sampler as sampler_module
from services.pd.runner.sampler import Sampler, processed_logits

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _hf_bias(logits_row: torch.Tensor, logit_bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """transformers' ``SequenceBiasLogitsProcessor`` with one-token sequences: OpenAI's logit_bias."""
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    if not logit_bias:
        return logits_row
    processor = SequenceBiasLogitsProcessor(sequence_bias={(token,): bias for token, bias in logit_bias})
    return processor(torch.zeros(1, 3, dtype=torch.long), logits_row[None].clone())[0]


def test_logit_bias_equals_transformers_sequence_bias():
    logits = _logits(4)
    original = logits.clone()
    biases = [((0, 5.0), (7, -100.0), (49, 0.5)), (), ((3, 100.0),), ((7, -2.25), (8, 2.25))]
    params = [SamplingParams(temperature=0.0, logit_bias=b) for b in biases]
    scores = processed_logits(logits, params)
    expected = torch.stack([_hf_bias(logits[i], b) for i, b in enumerate(biases)])
    assert torch.equal(scores, expected)
    assert torch.equal(logits, original)  # the logprobs' logits are left alone


def test_a_bias_steers_greedy_and_random_rows_but_not_logprobs():
    logits = _logits(3, seed=1)
    favourite, runner_up = logits[0].topk(2).indices.tolist()
    params = [
        SamplingParams(temperature=0.0, logit_bias=((favourite, -100.0),), logprobs=1),
        SamplingParams(temperature=0.0, logit_bias=((11, 100.0),)),
        SamplingParams(temperature=1.0, seed=3, logit_bias=((12, 100.0),)),
    ]
    out = Sampler().sample(logits, params, [0, 0, 0])
    assert [t.token_id for t in out] == [runner_up, 11, 12]
    assert out[0].top_token_ids == (favourite,)
    assert out[0].logprob == pytest.approx(logits[0].log_softmax(-1)[runner_up].item())


def test_a_masked_token_stays_masked_whatever_its_bias():
    logits = _logits(1, seed=2)
    scores = processed_logits(logits, [SamplingParams(logit_bias=((4, 100.0), (5, 1.0)))], [(4,)])
    assert scores[0, 4] == float("-inf")
    assert scores[0, 5] == logits[0, 5] + 1.0


def test_the_bias_comes_before_the_penalties_as_in_vllm():
    """A seen token at logit 1.0 with bias -3 and repetition 1.5: (1 - 3) * 1.5 = -3, not 1 / 1.5 - 3."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 1.0
    params = [SamplingParams(repetition_penalty=1.5, logit_bias=((9, -3.0),))]
    scores = processed_logits(logits, params, histories=[TokenHistory([9], ())])
    assert scores[0, 9].item() == pytest.approx(-3.0)


def test_without_logit_bias_nothing_is_added(monkeypatch):
    def no_bias(*args, **kwargs):
        raise AssertionError("logit_bias applied in a step where no row has one")

    monkeypatch.setattr(sampler_module, "_biased", no_bias)
    logits = _logits(2, seed=3)
    assert processed_logits(logits, [SamplingParams(), SamplingParams(temperature=0.0)]) is logits

"""Penalties on fixed logits: repetition against transformers, presence and frequency against OpenAI's formula."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from services.pd.engine.request import SamplingParams, TokenHistory
from services.pd.runner import sampler as sampler_module
from services.pd.runner.sampler import Sampler, processed_logits

VOCAB = 40


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _hf_repetition(logits_row: torch.Tensor, history: TokenHistory, penalty: float) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` on one row; its input_ids are prompt and output."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    input_ids = torch.tensor([[*history.prompt_token_ids, *history.output_token_ids]])
    return RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits_row[None].clone())[0]


def _openai_penalties(logits_row: torch.Tensor, output_ids, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's documented formula: ``logit -= count * frequency + (count > 0) * presence`` over the output."""
    row = logits_row.clone()
    for token, count in Counter(output_ids).items():
        row[token] -= count * frequency
        row[token] -= presence
    return row


HISTORIES = [
    TokenHistory([1, 2, 3, 3], [4, 5, 4]),
    TokenHistory([7], []),  # the first output token: only the prompt is seen
    TokenHistory([9, 10, 11, 12, 13, 14, 15, 16], [39, 0, 0, 0]),
    TokenHistory(list(range(VOCAB)), [5]),  # every token seen
]


def test_repetition_penalty_equals_transformers():
    logits = _logits(4)
    # Make the seen tokens' logits both signs, and one exactly zero.
    logits[0, 3], logits[0, 4], logits[0, 1] = 2.5, -1.5, 0.0
    original = logits.clone()
    penalties = [1.3, 0.7, 2.0, 1.05]
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    scores = processed_logits(logits, params, histories=HISTORIES)
    expected = torch.stack([_hf_repetition(logits[i], HISTORIES[i], penalties[i]) for i in range(4)])
    assert torch.equal(scores, expected)
    assert not torch.equal(scores, logits)
    assert torch.equal(logits, original)  # the logprobs' logits are left alone


def test_presence_and_frequency_count_the_output_only():
    logits = _logits(3, seed=1)
    params = [
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=1.5),
        SamplingParams(presence_penalty=-2.0, frequency_penalty=0.25),
    ]
    histories = [
        TokenHistory([], [4, 5, 4]),
        TokenHistory([], [6, 6, 6, 1]),
        TokenHistory([], [0, 39, 39]),
    ]
    scores = processed_logits(logits, params, histories=histories)
    expected = torch.stack(
        [
            _openai_penalties(logits[i], h.output_token_ids, p.presence_penalty, p.frequency_penalty)
            for i, (h, p) in enumerate(zip(histories, params))
        ]
    )
    assert torch.allclose(scores, expected, atol=1e-6)
    # A prompt token is no occurrence for them (PD sends the prompt only for repetition_penalty).
    with_prompt = processed_logits(logits, params, histories=[TokenHistory([1, 2, 3], h[1]) for h in histories])
    assert torch.allclose(with_prompt, expected, atol=1e-6)


def test_all_three_compose_in_vllm_order():
    """Repetition first (over prompt and output), then frequency and presence (over the output)."""
    logits = _logits(2, seed=2)
    params = [
        SamplingParams(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2),
        SamplingParams(temperature=0.0),  # no penalty: its row stays as it was
    ]
    history = TokenHistory([3, 8, 8], [8, 9, 9, 9])
    scores = processed_logits(logits, params, histories=[history, None])
    expected = _openai_penalties(_hf_repetition(logits[0], history, 1.4), history.output_token_ids, 0.3, 0.2)
    assert torch.allclose(scores[0], expected, atol=1e-6)
    assert torch.equal(scores[1], logits[1])


def test_penalties_change_greedy_choices_but_not_logprobs():
    logits = torch.zeros(2, VOCAB)
    logits[:, 5], logits[:, 6] = 3.0, 2.0  # 5 is the favourite, 6 the runner-up
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=1), SamplingParams(temperature=0.0)]
    histories = [TokenHistory([5], []), None]
    out = Sampler().sample(logits, params, [0, 0], None, histories)
    assert [t.token_id for t in out] == [6, 5]
    assert out[0].logprob == pytest.approx(logits[0].log_softmax(-1)[6].item())
    assert out[0].top_token_ids == (5,)  # the unpenalised distribution's top token
    # Seeded random rows see the penalised scores too: a banned-by-penalty favourite never comes.
    random = [SamplingParams(temperature=1.0, seed=s, frequency_penalty=2.0) for s in range(50)]
    peaked = torch.full((50, VOCAB), -30.0)
    peaked[:, 5], peaked[:, 6] = 3.0, 2.0
    drawn = Sampler().sample(peaked, random, [3] * 50, None, [TokenHistory([], [5, 5, 5])] * 50)
    assert {t.token_id for t in drawn} == {6}


def test_rows_without_history_cost_nothing(monkeypatch):
    logits = _logits(3, seed=3)
    params = [SamplingParams(repetition_penalty=1.5)] * 3

    def no_penalties(*args, **kwargs):
        raise AssertionError("penalties applied in a step where no row has a history")

    monkeypatch.setattr(sampler_module, "apply_penalties", no_penalties)
    assert processed_logits(logits, params, histories=[None] * 3) is logits
    assert processed_logits(logits, params) is logits


def test_an_empty_history_changes_nothing():
    logits = _logits(2, seed=4)
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)] * 2
    assert torch.equal(processed_logits(logits, params, histories=[TokenHistory([], [])] * 2), logits)


def test_penalties_follow_the_masked_ids():
    """The mask (min_tokens) first, as vLLM's order: a masked token stays -inf whatever its penalty."""
    logits = _logits(1, seed=5)
    params = [SamplingParams(repetition_penalty=0.5)]
    scores = processed_logits(logits, params, [(3,)], [TokenHistory([3, 4], [])])
    assert scores[0, 3] == float("-inf")
    assert torch.equal(scores[0, 4], _hf_repetition(logits[0], TokenHistory([4], []), 0.5)[4])


def test_histories_need_one_entry_per_row():
    with pytest.raises(ValueError):
        processed_logits(_logits(2), [SamplingParams()] * 2, histories=[None])

"""Sampling extensions on PD: the wire's checks (penalties, min_p, logit_bias, detokenizer options), and
the history a sampling chunk carries only when a penalty is on."""

from __future__ import annotations

import pytest
from scheduler_harness import TOKEN, chunk_of

from services.common.pb import epd_pb2
from services.pd import convert, sampling_convert
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.request import Request, SamplingParams


def _sampling(**fields) -> SamplingParams:
    return sampling_convert.sampling_from_pb(epd_pb2.SamplingParams(max_tokens=4, **fields), 16)


def test_the_wire_carries_the_penalties_and_unset_means_off():
    sampling = _sampling(repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=2.0)
    assert (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) == (1.25, -0.5, 2.0)
    default = _sampling()
    assert (default.repetition_penalty, default.presence_penalty, default.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not default.uses_penalties and sampling.uses_penalties


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": 101.0},
        {"repetition_penalty": float("nan")},
        {"presence_penalty": 2.5},
        {"presence_penalty": float("-inf")},
        {"frequency_penalty": -2.01},
        {"frequency_penalty": float("nan")},
    ],
    ids=str,
)
def test_the_wire_refuses_penalties_out_of_range(fields):
    with pytest.raises(EngineError) as refused:
        _sampling(**fields)
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT
    assert next(iter(fields)) in str(refused.value)


def test_the_wire_carries_min_p_and_refuses_it_out_of_range():
    assert _sampling(min_p=0.25).min_p == 0.25
    assert _sampling().min_p == 0.0
    for value in (-0.1, 1.5, float("nan")):
        with pytest.raises(EngineError) as refused:
            _sampling(min_p=value)
        assert refused.value.kind is ErrorKind.INVALID_ARGUMENT and "min_p" in str(refused.value)


def _request(**fields) -> Request:
    sampling = epd_pb2.SamplingParams(max_tokens=4, **fields)
    message = epd_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=sampling)
    return convert.request_from_pb(message, eos_token_ids=(2,), vocab_size=100, max_model_len=64)


def test_the_wire_carries_logit_bias_sorted_by_id():
    assert _request(logit_bias={99: -100.0, 0: 100.0, 5: 0.5}).sampling.logit_bias == (
        (0, 100.0),
        (5, 0.5),
        (99, -100.0),
    )
    assert _request().sampling.logit_bias == ()


@pytest.mark.parametrize(
    "logit_bias",
    [
        {100: 1.0},  # outside the vocabulary
        {1: 100.5},
        {1: float("-inf")},
        {1: float("nan")},
        {i: 1.0 for i in range(sampling_convert.MAX_LOGIT_BIAS_ENTRIES + 1)},
    ],
    ids=["id_outside_vocab", "above_100", "minus_inf", "nan", "too_many"],
)
def test_the_wire_refuses_a_logit_bias_the_logits_cannot_take(logit_bias):
    with pytest.raises(EngineError) as refused:
        _request(logit_bias=logit_bias)
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT and "logit_bias" in str(refused.value)


def test_the_wire_carries_the_detokenizer_options_and_unset_means_vllm_defaults():
    default = _sampling()
    assert (default.skip_special_tokens, default.spaces_between_special_tokens) == (True, True)
    assert default.include_stop_str_in_output is False
    sampling = _sampling(
        skip_special_tokens=False, spaces_between_special_tokens=False, include_stop_str_in_output=True
    )
    assert (sampling.skip_special_tokens, sampling.spaces_between_special_tokens) == (False, False)
    assert sampling.include_stop_str_in_output is True


def test_the_history_holds_the_prompt_only_for_repetition_penalty():
    prompt = [1, 2, 3]
    assert Request("r", prompt, SamplingParams()).penalty_history is None
    repetition = Request("r", prompt, SamplingParams(repetition_penalty=1.2))
    repetition.output_token_ids.append(TOKEN)
    assert repetition.penalty_history == ([1, 2, 3], (TOKEN,))
    presence = Request("p", prompt, SamplingParams(presence_penalty=0.1))
    assert presence.penalty_history == ((), ())


def test_only_sampling_chunks_of_penalised_requests_carry_a_history(h):
    penalised = h.add("a", list(range(10, 16)), max_tokens=3, repetition_penalty=1.5)
    h.add("b", [4, 5, 6], max_tokens=3)
    out, _ = h.step(prefill_budget=4)  # "a" gets a prefill chunk that does not sample
    assert not chunk_of(out, "a").sample and chunk_of(out, "a").history is None
    out, _ = h.step()
    assert chunk_of(out, "a").history == (list(range(10, 16)), ())
    out, _ = h.step()
    assert chunk_of(out, "a").history == (list(range(10, 16)), (TOKEN,))
    assert chunk_of(out, "b").sample and chunk_of(out, "b").history is None
    assert penalised.output_token_ids == [TOKEN, TOKEN]
    h.run()

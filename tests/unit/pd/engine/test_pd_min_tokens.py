"""min_tokens on PD: the wire's checks, the masked ids each chunk carries, and stops held off until it is reached."""

from __future__ import annotations

import pytest
from scheduler_harness import EOS, EOS_IDS, OTHER_EOS, TOKEN, chunk_of

from services.common.pb import epd_pb2
from services.pd import convert, sampling_convert
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.request import Request, RequestStatus, SamplingParams


def _generate(min_tokens: int, max_tokens: int = 8, stop_token_ids=(), prompt=(1, 2, 3)) -> epd_pb2.GenerateRequest:
    sampling = epd_pb2.SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_token_ids)
    return epd_pb2.GenerateRequest(request_id="r", prompt_token_ids=list(prompt), sampling=sampling)


def _from_pb(message: epd_pb2.GenerateRequest, max_model_len: int = 64) -> Request:
    return convert.request_from_pb(message, eos_token_ids=EOS_IDS, vocab_size=100, max_model_len=max_model_len)


def test_the_wire_carries_min_tokens_and_unset_means_none():
    assert _from_pb(_generate(5)).sampling.min_tokens == 5
    assert _from_pb(_generate(8)).sampling.min_tokens == 8
    assert sampling_convert.sampling_from_pb(epd_pb2.SamplingParams(max_tokens=4), 16).min_tokens == 0


def test_min_tokens_is_capped_by_the_room_left_in_the_context():
    sampling = _from_pb(_generate(0, max_tokens=0), max_model_len=8).sampling  # max_tokens 0: the whole room
    assert sampling.max_tokens == 5
    message = _generate(6, max_tokens=6)
    assert _from_pb(message, max_model_len=8).sampling.min_tokens == 5  # room for 5 tokens only


@pytest.mark.parametrize(
    "message",
    [_generate(9, max_tokens=8), _generate(1, stop_token_ids=[100])],
    ids=["above_max_tokens", "stop_id_outside_vocab"],
)
def test_the_wire_refuses_what_the_mask_cannot_take(message):
    with pytest.raises(EngineError) as refused:
        _from_pb(message)
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT


def test_the_wire_request_carries_every_eos_id():
    assert _from_pb(_generate(2)).eos_token_ids == EOS_IDS


def test_masked_ids_are_the_stop_tokens_until_min_tokens_outputs():
    sampling = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(5, 6))
    request = Request("r", [1], sampling, eos_token_ids=EOS_IDS)
    assert request.masked_token_ids == (EOS, OTHER_EOS, 5, 6)  # every EOS id, not only the first
    request.output_token_ids.append(TOKEN)
    assert request.masked_token_ids == (EOS, OTHER_EOS, 5, 6)
    request.output_token_ids.append(TOKEN)
    assert request.masked_token_ids == ()
    quiet = Request("q", [1], SamplingParams(min_tokens=2, ignore_eos=True), eos_token_ids=EOS_IDS)
    assert quiet.masked_token_ids == ()  # EOS is no stop here; no stop tokens either
    assert Request("n", [1], SamplingParams(min_tokens=2)).masked_token_ids == ()


def test_chunks_carry_the_mask_only_before_min_tokens(h):
    h.add("a", [1, 2, 3], max_tokens=6, min_tokens=2, stop_token_ids=(42,))
    h.add("b", [4, 5, 6], max_tokens=6)
    masks = []
    for _ in range(3):
        out, _ = h.step()
        masks.append((chunk_of(out, "a").masked_token_ids, chunk_of(out, "b").masked_token_ids))
    assert masks == [((EOS, OTHER_EOS, 42), ()), ((EOS, OTHER_EOS, 42), ()), ((), ())]
    h.run()


@pytest.mark.parametrize("stop", [EOS, OTHER_EOS, 42])
def test_no_stop_token_ends_a_request_within_min_tokens(h, stop):
    # Even were one sampled (the runner double ignores the mask), it is no stop within min_tokens.
    request = h.add("a", [1, 2, 3], max_tokens=6, min_tokens=3, stop_token_ids=(42,))
    for _ in range(3):
        h.step({"a": stop})
    assert request.status is RequestStatus.RUNNING and len(request.output_token_ids) == 3
    h.step({"a": stop})
    assert request.status is RequestStatus.FINISHED_STOPPED and len(request.output_token_ids) == 4


def test_min_tokens_equal_to_max_tokens_ends_by_length(h):
    request = h.add("a", [1, 2, 3], max_tokens=3, min_tokens=3)
    for _ in range(3):
        h.step({"a": EOS})
    assert request.status is RequestStatus.FINISHED_LENGTH and request.output_token_ids == [EOS] * 3

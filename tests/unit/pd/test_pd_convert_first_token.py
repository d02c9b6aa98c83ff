"""A KV push's first token and its logprobs, from the wire: checked against the vocabulary and itself."""

from __future__ import annotations

import pytest

from services.common.pb import epd_pb2
from services.pd import convert
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.outputs import SampledToken


def header(first: int, logprob: epd_pb2.TokenLogprob | None = None) -> epd_pb2.KVHeader:
    message = epd_pb2.KVHeader(first_token_id=first)
    if logprob is not None:
        message.first_token_logprob.CopyFrom(logprob)
    return message


def test_a_first_token_with_and_without_logprobs():
    assert convert.first_token_from_pb(header(5), 10) == SampledToken(5)
    logprob = epd_pb2.TokenLogprob(token_id=5, logprob=-0.5, top_token_ids=[5, 7], top_logprobs=[-0.5, -1.0])
    assert convert.first_token_from_pb(header(5, logprob), 10) == SampledToken(5, -0.5, (5, 7), (-0.5, -1.0))


@pytest.mark.parametrize(
    "message",
    [
        header(10),
        header(5, epd_pb2.TokenLogprob(token_id=6, logprob=-0.5)),
        header(5, epd_pb2.TokenLogprob(token_id=5, top_token_ids=[11], top_logprobs=[-1.0])),
        header(5, epd_pb2.TokenLogprob(token_id=5, top_token_ids=[1, 2], top_logprobs=[-1.0])),
    ],
    ids=["outside the vocabulary", "another token", "an alternative outside the vocabulary", "uneven lists"],
)
def test_bad_first_tokens_are_refused(message):
    with pytest.raises(EngineError) as refused:
        convert.first_token_from_pb(message, 10)
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT

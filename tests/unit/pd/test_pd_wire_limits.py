"""Second review, finding 10: PD's wire took request ids with control characters and unbounded stop_token_ids."""

from __future__ import annotations

import pytest

from services.common import grpc_utils
from services.common.pb import epd_pb2
from services.encoder.config import EncoderConfig
from services.pd import convert, sampling_convert
from services.pd.config import PdConfig
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.server import max_receive_bytes


@pytest.mark.parametrize("request_id", ["a\nb", "a\rb", "tab\there", "nul\x00", "esc\x1b[31m", "space here", "é"])
def test_request_ids_with_control_characters_or_spaces_are_refused(request_id):
    with pytest.raises(EngineError) as raised:
        convert.check_request_id(request_id)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT and request_id not in raised.value.message


@pytest.mark.parametrize("request_id", ["chatcmpl-0123abcd", "warmup-ff", "cmpl-1:2/3.x_y"])
def test_plain_request_ids_pass(request_id):
    assert convert.check_request_id(request_id) == request_id


def test_stop_token_ids_are_bounded():
    params = epd_pb2.SamplingParams(max_tokens=4, stop_token_ids=list(range(sampling_convert.MAX_STOP_TOKEN_IDS)))
    assert len(sampling_convert.sampling_from_pb(params, 16).stop_token_ids) == sampling_convert.MAX_STOP_TOKEN_IDS
    params.stop_token_ids.append(7)
    with pytest.raises(EngineError) as raised:
        sampling_convert.sampling_from_pb(params, 16)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT


def test_encoder_limits_a_colocated_pd_takes_encodes_of_the_encoders_bound_not_64_mib():
    """Security review, on a PD that serves Encode itself (``--encoder local``)."""
    colocated = max_receive_bytes(PdConfig(model="m", encoder="local"), max_model_len=4096)
    assert colocated == EncoderConfig().max_message_bytes < grpc_utils.MAX_MESSAGE_BYTES
    assert max_receive_bytes(PdConfig(model="m"), max_model_len=4096) < colocated


@pytest.mark.parametrize("cache_salt", ["secret", "A" * 64, "0" * 63, "0" * 65, "g" * 64])
def test_a_malformed_cache_salt_is_refused_without_being_echoed(cache_salt):
    message = epd_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], cache_salt=cache_salt)
    with pytest.raises(EngineError) as raised:
        convert.request_from_pb(message, eos_token_ids=(0,), vocab_size=16, max_model_len=64)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT and "cache_salt" in raised.value.message
    assert cache_salt not in raised.value.message


def test_a_well_formed_cache_salt_reaches_the_request():
    message = epd_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], cache_salt="0f" * 32)
    assert convert.request_from_pb(message, eos_token_ids=(0,), vocab_size=16, max_model_len=64).cache_salt == "0f" * 32
    message.cache_salt = ""
    assert convert.request_from_pb(message, eos_token_ids=(0,), vocab_size=16, max_model_len=64).cache_salt == ""

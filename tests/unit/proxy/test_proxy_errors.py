"""The gRPC -> HTTP error table, OpenAI error bodies, config and sampling checks."""

from __future__ import annotations

import grpc
import pytest

from services.proxy.config import ProxyConfig
from services.proxy.errors import (
    PromptTooLongError,
    RequestError,
    UnsupportedFeatureError,
    body_too_large,
    from_grpc,
    missing_extra,
    model_not_found,
)
from services.proxy.openai.sampling import (
    check_supported,
    choice_sampling,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
)
from services.proxy.openai.schemas import ChatCompletionRequest, CompletionRequest

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("code", "status", "retry_after"),
    [
        (S.INVALID_ARGUMENT, 400, None),
        (S.RESOURCE_EXHAUSTED, 503, 1),
        (S.UNAVAILABLE, 503, 1),
        (S.DEADLINE_EXCEEDED, 504, None),
        (S.FAILED_PRECONDITION, 500, None),
        (S.NOT_FOUND, 500, None),
        (S.INTERNAL, 500, None),
        (S.UNKNOWN, 500, None),
        (S.CANCELLED, 500, None),
    ],
)
def test_grpc_status_table(code, status, retry_after):
    error = from_grpc(code)
    assert error.status_code == status
    assert error.retry_after_s == retry_after
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == ("invalid_request_error" if status == 400 else "server_error")


def test_a_missing_extra_is_the_clients_400_naming_it():
    error = missing_extra("structured")
    assert error is not None and error.status_code == 400
    assert error.body()["error"]["code"] == "structured_outputs_unavailable"
    assert error.body()["error"]["type"] == "invalid_request_error"
    assert "pip install 'epd-cluster[structured]'" in error.message
    assert missing_extra("anything else") is None  # an unknown name keeps the status table's answer


@pytest.mark.parametrize(("hint_ms", "seconds"), [(0, 1), (1, 1), (1000, 1), (1001, 2), (7500, 8)])
def test_retry_after_rounds_hint_up_to_whole_seconds(hint_ms, seconds):
    error = from_grpc(S.RESOURCE_EXHAUSTED, hint_ms)
    assert error.response_headers() == {"Retry-After": str(seconds)}


def test_fixed_errors():
    assert model_not_found().status_code == 404
    assert model_not_found().body()["error"]["code"] == "model_not_found"
    assert body_too_large(10).status_code == 413


def test_request_errors_map_to_400_with_code_and_param():
    api = PromptTooLongError("too long", "messages").to_api_error()
    assert (api.status_code, api.code, api.param, api.error_type) == (
        400,
        "context_length_exceeded",
        "messages",
        "invalid_request_error",
    )


# --------------------------------------------------------------------------- config


def test_config_defaults_are_valid():
    config = ProxyConfig(model="m")
    assert config.port == 8000 and config.pd_addresses == ("127.0.0.1:21061",)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": 70000},
        {"pd_addresses": ()},
        {"pd_addresses": ("nohostport",)},
        {"pd_addresses": ("a:1", "a:1")},
        {"encoder_addresses": ("host:0",)},
        {"request_timeout_s": 0},
        {"max_body_bytes": -1},
        {"max_image_pixels": 0},
        {"max_images_per_request": -1},
        {"default_max_tokens": 100, "max_tokens_limit": 10},
        {"lease_ms": -5},
        {"lease_ms": 10_000, "request_timeout_s": 1},
        {"served_model_name": "  "},
        {"pd_policy": "random"},
        {"encoder_policy": "sticky"},
        {"api_key": " "},
        {"allowed_media_domains": ("example.com/path",)},
        {"allowed_media_domains": ("*example.com",)},
        {"max_n": 0},
        {"breaker_failures": 0},
        {"load_poll_s": -1},
    ],
)
def test_config_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        ProxyConfig(model="m", **kwargs)


def test_config_hides_the_api_key_and_normalises_domains():
    config = ProxyConfig(model="m", api_key="s3cret-key", allowed_media_domains=["Images.Example.com", "*.cdn.org"])
    assert "s3cret-key" not in repr(config)
    assert config.allowed_media_domains == ("images.example.com", "*.cdn.org")


def test_choice_sampling_offsets_the_seed_only():
    base = sampling_params(chat(seed=2**64 - 1, temperature=0.7), 5)
    assert choice_sampling(base, 0) is base
    second = choice_sampling(base, 1)
    assert second.seed == 0 and second.temperature == pytest.approx(0.7) and base.seed == 2**64 - 1
    unseeded = sampling_params(chat(temperature=0.7), 5)
    assert not choice_sampling(unseeded, 3).HasField("seed")


def test_config_is_frozen_and_lists_become_tuples():
    config = ProxyConfig(model="m", pd_addresses=["a:1", "b:2"])
    assert config.pd_addresses == ("a:1", "b:2")
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]


# --------------------------------------------------------------------------- sampling


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_max_tokens_resolution():
    assert resolve_max_tokens(None, 10, 100, limit=50, default=20) == 20
    assert resolve_max_tokens(None, 90, 100, limit=50, default=20) == 10  # default capped by room
    assert resolve_max_tokens(5, 10, 100, limit=50, default=20) == 5
    with pytest.raises(PromptTooLongError):
        resolve_max_tokens(None, 100, 100, limit=50, default=20)
    with pytest.raises(PromptTooLongError):
        resolve_max_tokens(20, 90, 100, limit=50, default=20)
    with pytest.raises(RequestError):
        resolve_max_tokens(60, 10, 1000, limit=50, default=20)


def test_sampling_params_keep_unset_fields_unset():
    params = sampling_params(chat(), 7)
    assert params.max_tokens == 7
    assert not params.HasField("temperature") and not params.HasField("seed") and not params.HasField("logprobs")


def test_sampling_params_pass_everything_through():
    body = chat(temperature=0, top_p=0.5, seed=3, stop=["a", "b"], logprobs=True, top_logprobs=2, top_k=4)
    params = sampling_params(body, 9)
    assert params.HasField("temperature") and params.temperature == 0.0
    assert params.top_p == 0.5 and params.seed == 3 and params.top_k == 4
    assert list(params.stop) == ["a", "b"]
    assert params.logprobs == 2
    assert sampling_params(chat(logprobs=True), 1).logprobs == 0
    assert sampling_params(CompletionRequest(prompt="x", logprobs=3), 1).logprobs == 3


def test_stop_accepts_string_or_list_and_bounds_it():
    assert stop_strings("x") == ["x"]
    assert stop_strings(None) == []
    with pytest.raises(RequestError):
        stop_strings([""])
    with pytest.raises(RequestError):
        stop_strings(["s"] * 100)


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [{"type": "function"}]},
        {"tool_choice": "auto"},
    ],
)
def test_unsupported_parameters_are_rejected_not_dropped(fields):
    with pytest.raises(UnsupportedFeatureError):
        check_supported(chat(**fields))


def test_supported_defaults_pass():
    check_supported(chat(n=1, presence_penalty=0, response_format={"type": "text"}))
    check_supported(chat(n=8), max_n=8)
    with pytest.raises(RequestError) as caught:
        check_supported(chat(n=9), max_n=8)
    assert caught.value.param == "n"
    check_supported(CompletionRequest(prompt="x", echo=True))  # echo is honoured
    with pytest.raises(UnsupportedFeatureError) as refused:
        check_supported(CompletionRequest(prompt="x", echo=True, logprobs=1))  # the prompt's logprobs are not
    assert refused.value.param == "echo"
    with pytest.raises(UnsupportedFeatureError) as refused:
        check_supported(CompletionRequest(prompt="x", suffix="y"))
    assert refused.value.param == "suffix"

"""OpenAI request fields -> ``epd.v1.SamplingParams``, and the checks that go with them."""

from __future__ import annotations

import re
from typing import Any

from services.common.pb import epd_pb2
from services.proxy.errors import PromptTooLongError, RequestError, UnsupportedFeatureError
from services.proxy.openai.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from services.proxy.openai.structured import structured_output

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MIN_FLOAT32 = 1.1754943508222875e-38  # smallest normal float32
MAX_LOGIT_BIAS_ENTRIES = 300  # as OpenAI's API
MAX_LOGIT_BIAS = 100.0
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")  # decimal, no leading zeros: one spelling per id


def check_supported(body: _SamplingFields, max_n: int = 1) -> None:
    """Rejects valid OpenAI parameters this server does not implement (never drops them silently)."""
    if body.n is not None and body.n > max_n:
        raise RequestError(f"n must be at most {max_n}.", "n")
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options is only allowed when stream is true.", "stream_options")
    if isinstance(body, ChatCompletionRequest):
        if body.tools or body.tool_choice not in (None, "none"):
            raise UnsupportedFeatureError("Tool calling is not supported.", "tools")
        for index, message in enumerate(body.messages):
            if message.content is None and message.role != "assistant":
                raise RequestError("Message content is required.", f"messages[{index}].content")
        check_chat_template_kwargs(body.chat_template_kwargs)
    structured_output(body)  # refused before any work (sampling_params builds it again, cheaply)
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise UnsupportedFeatureError("suffix is not supported.", "suffix")
        if body.echo and body.logprobs is not None:
            raise UnsupportedFeatureError("echo with logprobs (the prompt's logprobs) is not supported.", "echo")
        if body.best_of not in (None, 1):
            raise UnsupportedFeatureError("Only best_of=1 is supported.", "best_of")


MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_VALUE_CHARS = 1024
# apply_chat_template's own arguments: a client may set template variables, never how the prompt is built.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "documents",
        "max_length",
        "messages",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "tokenize",
        "tokenizer_kwargs",
        "processor_kwargs",
        "tools",
        "truncation",
    }
)


def check_chat_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """400 unless ``chat_template_kwargs`` is at most ``MAX_TEMPLATE_KWARGS`` template variables: identifiers
    that are not ``apply_chat_template``'s own arguments, with scalar values (strings bounded)."""
    if not kwargs:
        return
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"chat_template_kwargs has more than {MAX_TEMPLATE_KWARGS} entries.", "chat_template_kwargs")
    for key, value in kwargs.items():
        if not (key.isidentifier() and key.isascii() and len(key) <= 64) or key.startswith("_"):
            raise RequestError("chat_template_kwargs keys must be template variable names.", "chat_template_kwargs")
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise RequestError(
                "chat_template_kwargs may set template variables, not how the prompt is built.",
                "chat_template_kwargs",
            )
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_VALUE_CHARS:
            raise RequestError(
                f"chat_template_kwargs values are at most {MAX_TEMPLATE_VALUE_CHARS} characters.",
                "chat_template_kwargs",
            )


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """Normalises ``stop`` (a string or a list) and bounds it."""
    if stop is None:
        return []
    strings = [stop] if isinstance(stop, str) else list(stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise RequestError(f"At most {MAX_STOP_STRINGS} stop sequences are allowed.", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in strings):
        raise RequestError(f"Stop sequences must have 1 to {MAX_STOP_CHARS} characters.", "stop")
    return strings


def _stop_token_ids(token_ids: list[int] | None) -> list[int]:
    token_ids = token_ids or []
    if len(token_ids) > MAX_STOP_STRINGS or any(not 0 <= t < 2**32 for t in token_ids):
        raise RequestError(f"stop_token_ids must be at most {MAX_STOP_STRINGS} non-negative ids.", "stop_token_ids")
    return token_ids


def check_stop_token_ids(token_ids: list[int] | None, vocab_size: int) -> None:
    """Refuses stop token ids the model cannot produce, before any work is spent on the request."""
    if token_ids and any(not 0 <= t < vocab_size for t in token_ids):
        raise RequestError(f"stop_token_ids must be in [0, {vocab_size}).", "stop_token_ids")


def check_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """``logit_bias`` as token id -> bias, checked before any work is spent on the request.

    OpenAI's shape: keys are token ids written in decimal, values in
    [-100, 100], at most 300 entries; each id must be in the vocabulary.
    """
    if not logit_bias:
        return {}
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries.", "logit_bias")
    if not all(_TOKEN_ID_KEY.fullmatch(key) for key in logit_bias):
        raise RequestError("logit_bias keys must be token ids (decimal, no leading zeros).", "logit_bias")
    biases = {int(key): bias for key, bias in logit_bias.items()}
    if any(token_id >= vocab_size for token_id in biases):
        raise RequestError(f"logit_bias token ids must be in [0, {vocab_size}).", "logit_bias")
    if any(not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for bias in biases.values()):
        raise RequestError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}].", "logit_bias")
    return biases


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, max_model_len: int, *, limit: int, default: int
) -> int:
    """How many tokens to generate: the client's ask, checked; or the default, capped by context room."""
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise PromptTooLongError(
            f"The prompt has {num_prompt_tokens} tokens; the model's context is {max_model_len}.", "messages"
        )
    if requested is None:
        return min(default, room)
    if requested > limit:
        raise RequestError(f"max_tokens must be at most {limit}.", "max_tokens")
    if requested > room:
        raise PromptTooLongError(
            f"The prompt ({num_prompt_tokens} tokens) plus max_tokens ({requested}) exceeds "
            f"the model's context of {max_model_len} tokens.",
            "max_tokens",
        )
    return requested


def requested_max_tokens(body: _SamplingFields) -> int | None:
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def requested_logprobs(body: _SamplingFields) -> int | None:
    """Number of top alternatives per token, or None when logprobs are off."""
    if isinstance(body, ChatCompletionRequest):
        if not body.logprobs:
            if body.top_logprobs:
                raise RequestError("top_logprobs requires logprobs=true.", "top_logprobs")
            return None
        return body.top_logprobs or 0
    assert isinstance(body, CompletionRequest)
    return body.logprobs


def choice_sampling(params: epd_pb2.SamplingParams, index: int) -> epd_pb2.SamplingParams:
    """Sampling of choice ``index`` of ``n``: a given seed is offset per choice, so the
    choices differ from each other yet the whole response stays reproducible."""
    if index == 0 or not params.HasField("seed"):
        return params
    copy = epd_pb2.SamplingParams()
    copy.CopyFrom(params)
    copy.seed = (params.seed + index) % 2**64
    return copy


def sampling_params(body: _SamplingFields, max_tokens: int) -> epd_pb2.SamplingParams:
    """Builds the wire sampling parameters; unset optional fields keep PD's defaults.

    ``max_tokens`` is the resolved one (``resolve_max_tokens``): ``min_tokens`` may not exceed it.
    """
    if body.min_tokens > max_tokens:
        raise RequestError(f"min_tokens must be at most max_tokens ({max_tokens}).", "min_tokens")
    params = epd_pb2.SamplingParams(
        max_tokens=max_tokens,
        stop=stop_strings(body.stop),
        stop_token_ids=_stop_token_ids(body.stop_token_ids),
        ignore_eos=body.ignore_eos,
    )
    if body.temperature is not None:
        params.temperature = body.temperature
    if body.top_p is not None:
        # The wire field is float32: a positive top_p below its range would arrive as 0 (invalid).
        params.top_p = max(body.top_p, MIN_FLOAT32)
    if body.top_k is not None:
        params.top_k = body.top_k
    if body.seed is not None:
        params.seed = body.seed
    if body.min_tokens:
        params.min_tokens = body.min_tokens
    if body.repetition_penalty is not None:
        # float32 on the wire: a positive penalty below its range would arrive as 0 (invalid).
        params.repetition_penalty = max(body.repetition_penalty, MIN_FLOAT32)
    if body.min_p:
        params.min_p = body.min_p
    if not body.skip_special_tokens:
        params.skip_special_tokens = False
    if not body.spaces_between_special_tokens:
        params.spaces_between_special_tokens = False
    params.include_stop_str_in_output = body.include_stop_str_in_output
    if body.logit_bias:
        params.logit_bias.update({int(key): bias for key, bias in body.logit_bias.items()})  # checked already
    if body.presence_penalty is not None:
        params.presence_penalty = body.presence_penalty
    if body.frequency_penalty is not None:
        params.frequency_penalty = body.frequency_penalty
    logprobs = requested_logprobs(body)
    if logprobs is not None:
        params.logprobs = logprobs
    constraint = structured_output(body)
    if constraint is not None:
        params.structured_output.CopyFrom(constraint)
    return params

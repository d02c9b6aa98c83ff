"""Proto -> domain conversion of a Generate's ``SamplingParams`` and its structured output, with their bounds.

Part of PD's wire conversion (``convert.py``, which builds the whole ``Request``):
everything is validated here, so the engine only sees well-formed parameters.
Messages never echo input.
"""

from __future__ import annotations

import json

from services.common.pb import epd_pb2
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.request import SamplingParams, StructuredOutputSpec

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REPETITION_PENALTY = 100.0  # vLLM asks only > 0; past this a seen token is as good as banned anyway
MAX_PRESENCE_PENALTY = 2.0  # presence and frequency: OpenAI's [-2, 2]
MAX_LOGIT_BIAS_ENTRIES = 300  # as OpenAI's API
MAX_LOGIT_BIAS = 100.0
MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema, regex or grammar (the proxy's bound too): compile work stays small
MAX_CHOICES = 256


def _invalid(message: str) -> EngineError:
    return EngineError(ErrorKind.INVALID_ARGUMENT, message)


def sampling_from_pb(params: epd_pb2.SamplingParams, max_tokens_cap: int) -> SamplingParams:
    temperature = params.temperature if params.HasField("temperature") else 1.0
    top_p = params.top_p if params.HasField("top_p") else 1.0
    top_k = params.top_k if params.HasField("top_k") else 0
    if not 0.0 <= temperature <= 100.0 or temperature != temperature:
        raise _invalid("temperature must be between 0 and 100")
    if not 0.0 < top_p <= 1.0:
        raise _invalid("top_p must be in (0, 1]")
    if not 0.0 <= params.min_p <= 1.0:  # unset reads 0.0, off
        raise _invalid("min_p must be in [0, 1]")
    if params.HasField("logprobs") and params.logprobs > MAX_LOGPROBS:
        raise _invalid(f"logprobs must be at most {MAX_LOGPROBS}")
    if len(params.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LEN for s in params.stop):
        raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings of 1..{MAX_STOP_LEN} characters")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise _invalid(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries")
    if any(not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for bias in params.logit_bias.values()):
        raise _invalid(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    if params.max_tokens and params.min_tokens > params.max_tokens:
        raise _invalid("min_tokens must not exceed max_tokens")
    structured_output = structured_output_from_pb(params)
    if structured_output is not None and params.min_tokens:
        # Once the grammar is complete only a stop token is allowed, which min_tokens forbids.
        raise _invalid("min_tokens cannot be combined with a structured output")
    repetition_penalty, presence_penalty, frequency_penalty = _penalties(params)
    max_tokens = min(params.max_tokens or max_tokens_cap, max_tokens_cap)
    return SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=params.seed if params.HasField("seed") else None,
        max_tokens=max_tokens,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        min_tokens=min(params.min_tokens, max_tokens),  # the context's room ends a request all the same
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        min_p=float(params.min_p),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in params.logit_bias.items())),
        skip_special_tokens=params.skip_special_tokens if params.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(
            params.spaces_between_special_tokens if params.HasField("spaces_between_special_tokens") else True
        ),
        include_stop_str_in_output=params.include_stop_str_in_output,
        structured_output=structured_output,
    )


def structured_output_from_pb(params: epd_pb2.SamplingParams) -> StructuredOutputSpec | None:
    """The constraint of ``params`` (None when unset), bounded; whether it compiles is the compiler's to say."""
    if not params.HasField("structured_output"):
        return None
    constraint = params.structured_output
    kind = constraint.WhichOneof("constraint")
    if kind is None:
        raise _invalid("structured_output names no constraint")
    if kind == "json_object":
        if not constraint.json_object:
            raise _invalid("structured_output.json_object must be true")
        return StructuredOutputSpec("json_object")
    if kind == "choice":
        choices = list(constraint.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise _invalid(f"structured_output.choice must have 1..{MAX_CHOICES} strings")
        value = json.dumps(choices)
    else:
        value = getattr(constraint, kind)
    if len(value.encode()) > MAX_CONSTRAINT_BYTES:
        raise _invalid(f"structured_output is larger than {MAX_CONSTRAINT_BYTES} bytes")
    return StructuredOutputSpec(kind, value)


def _penalties(params: epd_pb2.SamplingParams) -> tuple[float, float, float]:
    """``(repetition, presence, frequency)``: unset = off; out of range (NaN included) is refused."""
    repetition = params.repetition_penalty if params.HasField("repetition_penalty") else 1.0
    presence = params.presence_penalty if params.HasField("presence_penalty") else 0.0
    frequency = params.frequency_penalty if params.HasField("frequency_penalty") else 0.0
    if not 0.0 < repetition <= MAX_REPETITION_PENALTY:
        raise _invalid(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]")
    if not (-MAX_PRESENCE_PENALTY <= presence <= MAX_PRESENCE_PENALTY):
        raise _invalid(f"presence_penalty must be in [-{MAX_PRESENCE_PENALTY:g}, {MAX_PRESENCE_PENALTY:g}]")
    if not (-MAX_PRESENCE_PENALTY <= frequency <= MAX_PRESENCE_PENALTY):
        raise _invalid(f"frequency_penalty must be in [-{MAX_PRESENCE_PENALTY:g}, {MAX_PRESENCE_PENALTY:g}]")
    return float(repetition), float(presence), float(frequency)

"""Request bodies of the OpenAI-compatible endpoints (pydantic).

Every field declared here is honoured; a value we cannot honour is refused
in ``sampling.py`` with a clear 400. Fields not declared are kept aside
(``extra="allow"``, so they cost one validation pass) and judged by
``fields.py``: a field we know and do not implement is refused unless it has
its no-op value, anything else is unknown and ignored (a 400 under
``--no-ignore-unknown-fields``). Types are strict, as OpenAI's are: ``"5"``
is not an integer and ``"yes"`` is not a boolean.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.proxy.cache_isolation import MAX_CACHE_SALT_CHARS

_MAX_TEXT_PARTS = 1024  # per message; bounds work before the body reaches the tokenizer
_MAX_FRAME_URLS = 768  # frames of one video given as images (transformers' Qwen2-VL max_frames)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ImageUrl(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrl(_Body):
    """A video: a data/https URL, or its frames as image URLs (at most ``_MAX_FRAME_URLS``)."""

    url: str | Annotated[list[str], Field(min_length=1, max_length=_MAX_FRAME_URLS)]


class VideoPart(_Body):
    type: Literal["video_url"]
    video_url: VideoUrl


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    # None is allowed for assistant turns only (OpenAI sends it with tool calls).
    content: str | Annotated[list[ContentPart], Field(max_length=_MAX_TEXT_PARTS)] | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """``response_format.json_schema`` (OpenAI's). ``strict`` is accepted either way: the output always
    follows the schema (the grammar library's strict mode: no properties beyond those declared)."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """``text``, ``json_object`` or ``json_schema`` (with ``json_schema``); checked in ``structured.py``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of its constraints (checked in ``structured.py``)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Body):
    """Fields shared by both endpoints."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, lt=2**31)  # extension (vLLM): <= 0 disables
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    return_token_ids: bool = False  # extension: choices carry the generated token ids
    min_tokens: int = Field(default=0, ge=0, lt=2**32)  # extension: no stop before this many tokens (<= max_tokens)
    n: int | None = Field(default=None, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # over output tokens (OpenAI's)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # per output occurrence (OpenAI's)
    # extension (vLLM): divides a seen token's logit (prompt or output) when positive, multiplies it otherwise
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension (vLLM): relative to the top token
    skip_special_tokens: bool = True  # extension (vLLM): special tokens left out of the text
    spaces_between_special_tokens: bool = True  # extension (vLLM): to the tokenizer's decode
    include_stop_str_in_output: bool = False  # extension (vLLM): the stop string (or token) ends the text
    logit_bias: dict[str, float] | None = None  # token id -> bias; checked in sampling.check_logit_bias
    user: str | None = Field(default=None, max_length=256)  # accepted (OpenAI end-user id), not used
    safety_identifier: str | None = Field(default=None, max_length=256)  # user's successor; accepted, not used
    # extension (vLLM): only requests with the same salt (and tenant) share cache entries; cache_isolation.py
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # extensions (vLLM): constrained decoding, one constraint per request (structured.py)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=256)  # a cache hint; prefix caching is automatic
    # extension (vLLM): variables for the chat template (e.g. a model's ``enable_thinking``), checked in sampling.py
    chat_template_kwargs: dict[str, str | bool | int | float | None] | None = None
    # extension (vLLM): video sampling (fps, num_frames, max_frames), checked in videos.sampling_options
    mm_processor_kwargs: dict[str, int | float] | None = None

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` (text-only)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for model in models:
        names.update(field.alias or name for name, field in model.model_fields.items())
    return frozenset(names)


FIELD_NAMES = _field_names(
    ImageUrl,
    TextPart,
    ImagePart,
    VideoUrl,
    VideoPart,
    ChatMessage,
    StreamOptions,
    JsonSchemaFormat,
    ResponseFormat,
    StructuredOutputs,
    ChatCompletionRequest,
    CompletionRequest,
)
"""Every field name of the request schemas: the only strings an error location may repeat."""

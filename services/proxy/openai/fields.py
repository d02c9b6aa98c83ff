"""The request surface: every body field is honoured, refused or ignored, and the client is told which.

``schemas.py`` declares the fields this server honours (OpenAI's and the
vLLM-compatible ``EXTENSIONS``). A field it does not declare is one of:

- a field whose meaning we know and do not implement (``NOT_IMPLEMENTED``:
  OpenAI's, and vLLM's and SGLang's that change the output): accepted only
  with its no-op value (``store: false``, ``modalities: ["text"]``,
  ``use_beam_search: false``, ...), otherwise a 400 ``unsupported_parameter``
  naming it: ignoring it would answer a question the client did not ask;
- unknown: ignored, as vLLM and SGLang ignore them (clients add fields of
  their own), and the handler names it in ``X-EPD-Ignored-Fields`` and in one
  log line. ``--no-ignore-unknown-fields`` refuses it instead, a 400
  ``unknown_parameter`` naming it.

The same holds inside nested objects (messages, content parts, image_url,
stream_options, response_format and its json_schema, structured_outputs). Names come back to the client only when
they are plain identifiers; a value never does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from services.proxy.errors import UnknownFieldError, UnsupportedFeatureError
from services.proxy.openai.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions

EXTENSIONS = (
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "return_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "cache_salt",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
)
"""vLLM-compatible request fields beyond OpenAI's, all honoured (README: "Request fields")."""

_DISABLED = (None, False)
_EMPTY: tuple[object, ...] = (None, [], {})
_NULL = (None,)

# vLLM's (and SGLang's) request fields that change what comes back, on both endpoints -> their no-op values.
_PEER_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": _DISABLED,
    "length_penalty": (None, 1.0, 1),
    "truncate_prompt_tokens": _NULL,
    "prompt_logprobs": _NULL,
    "logprob_token_ids": _EMPTY,
    "allowed_token_ids": _NULL,
    "bad_words": _EMPTY,
    "logits_processors": _EMPTY,
    "priority": (None, 0),
    "return_tokens_as_token_ids": _DISABLED,
    "return_token_offsets": _DISABLED,
    "return_prompt_text": _DISABLED,
    "kv_transfer_params": _NULL,
    "ec_transfer_params": _NULL,
    "vllm_xargs": _EMPTY,
    "thinking_token_budget": _NULL,
    "repetition_detection": _NULL,
    "guided_grammar": _NULL,
    "guided_whitespace_pattern": _NULL,
    "regex": _NULL,  # SGLang's constraints
    "ebnf": _NULL,
    "lora_path": _NULL,
    "no_stop_trim": _DISABLED,
    "return_hidden_states": _DISABLED,
}
# ... and on chat only (completions honours ``echo``).
_PEER_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    "echo": _DISABLED,
    "add_generation_prompt": (None, True),
    "continue_final_message": _DISABLED,
    "add_special_tokens": _DISABLED,
    "documents": _EMPTY,
    "chat_template": _NULL,
    "include_reasoning": (None, True),  # no reasoning parser: the reasoning is in the content
    "media_io_kwargs": _EMPTY,
}

# OpenAI fields this server does not implement -> the values that ask for nothing (accepted).
NOT_IMPLEMENTED: dict[type[BaseModel], dict[str, tuple[Any, ...]]] = {
    ChatCompletionRequest: {
        "audio": (None,),
        "functions": _EMPTY,
        "function_call": (None, "none"),
        "metadata": _EMPTY,
        "modalities": (None, ["text"]),
        "moderation": (None,),
        "parallel_tool_calls": (None, True, False),  # no tools are served, so there is nothing to parallelise
        "prediction": (None,),
        "prompt_cache_options": (None,),
        "prompt_cache_retention": (None,),
        "reasoning_effort": (None,),
        "service_tier": (None, "auto", "default"),
        "store": _DISABLED,
        "verbosity": (None,),
        "web_search_options": (None,),
        **_PEER_FIELDS,
        **_PEER_CHAT_FIELDS,
    },
    CompletionRequest: dict(_PEER_FIELDS),
    # Keys of OpenAI messages this server has no use for (the SDK echoes them back in conversation history).
    ChatMessage: {
        "tool_calls": _EMPTY,
        "tool_call_id": (None,),
        "function_call": (None,),
        "audio": (None,),
        "refusal": (None,),
        "annotations": _EMPTY,
    },
    StreamOptions: {"include_obfuscation": _DISABLED},
}

IGNORED_FIELDS_HEADER = "X-EPD-Ignored-Fields"
MAX_IGNORED_NAMES = 16
MAX_HEADER_CHARS = 512
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}")
_UNNAMED = "?"  # stands for a key that is not a plain identifier (it might carry input)
_INDEX = re.compile(r"\[\d+\]")


def _is_noop(value: Any, allowed: tuple[Any, ...]) -> bool:
    # Same type as well as equal: 0 is not False and 1.0 is not True.
    return any(type(value) is type(a) and value == a for a in allowed)


def _shown(name: str) -> str:
    return name if _PLAIN_NAME.fullmatch(name) else _UNNAMED


def _extras(model: BaseModel, path: str) -> Iterator[tuple[BaseModel, str, str, Any]]:
    """``(model, path, key, value)`` of every undeclared key in ``model`` and the models under it."""
    for key, value in (model.__pydantic_extra__ or {}).items():
        yield model, path, key, value
    for name in type(model).model_fields:
        child = getattr(model, name)
        if isinstance(child, BaseModel):
            yield from _extras(child, f"{path}{name}.")
        elif isinstance(child, list):
            for index, item in enumerate(child):
                if isinstance(item, BaseModel):
                    yield from _extras(item, f"{path}{name}[{index}].")


def check_fields(body: BaseModel, *, ignore_unknown: bool = True) -> list[str]:
    """Refuses the undeclared fields of ``body`` that ask for something; returns the ignored ones.

    Raises ``UnsupportedFeatureError`` for a ``NOT_IMPLEMENTED`` field set to
    anything but its no-op value, and ``UnknownFieldError`` for an unknown
    field when not ``ignore_unknown``. Returns the ignored fields' paths
    without list indexes (``messages.x``), each once, in order of appearance.
    """
    ignored: list[str] = []
    for model, path, key, value in _extras(body, ""):
        allowed = NOT_IMPLEMENTED.get(type(model), {}).get(key)
        if allowed is not None:
            if not _is_noop(value, allowed):
                raise UnsupportedFeatureError(f"{key} is not supported.", path + key)
            continue
        name = _shown(key)
        if not ignore_unknown:
            if name == _UNNAMED:
                raise UnknownFieldError("Unknown field (its name is not a plain identifier).", path[:-1] or None)
            raise UnknownFieldError(f"Unknown field {name}.", path + name)
        plain = _INDEX.sub("", path) + name
        if plain not in ignored:
            ignored.append(plain)
    return ignored


def ignored_fields_header(names: list[str]) -> dict[str, str]:
    """``X-EPD-Ignored-Fields``: the ignored names, bounded in number and length ({} when none).

    Names that do not fit are replaced by a final ``...``.
    """
    shown: list[str] = []
    length = 0
    for name in names:
        if len(shown) == MAX_IGNORED_NAMES or length + len(name) + 1 > MAX_HEADER_CHARS - 4:
            shown.append("...")
            break
        shown.append(name)
        length += len(name) + 1
    return {IGNORED_FIELDS_HEADER: ",".join(shown)} if shown else {}

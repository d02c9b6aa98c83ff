"""The proxy's OpenAPI document (``GET /openapi.json``).

Handlers read and validate their bodies themselves (``http_util.parse_body``:
size limit first, strict types, errors that never echo input), so FastAPI
cannot derive request bodies from their signatures. This module describes
them from the same pydantic models, together with every response an endpoint
can give: the document is what clients and the schema-fuzzing test rely on.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from services.proxy.errors import MAX_MESSAGE_CHARS, MAX_PARAM_CHARS
from services.proxy.openai.fields import IGNORED_FIELDS_HEADER, MAX_HEADER_CHARS, NOT_IMPLEMENTED
from services.proxy.openai.sampling import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_CHARS, MAX_STOP_STRINGS
from services.proxy.openai.schemas import ChatCompletionRequest, CompletionRequest
from services.proxy.openai.structured import MAX_CHOICES

_REF = "#/components/schemas/{model}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "maxLength": MAX_MESSAGE_CHARS},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"], "maxLength": MAX_PARAM_CHARS},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
_FINISH_REASON = {"enum": ["stop", "length"]}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}  # with return_token_ids (vLLM's)
# One server-sent event (OpenAPI < 3.2: ``schema`` describes each event of a stream).
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def _completion(object_name: str, choice: dict[str, Any], *, prompt_ids_in_choice: bool) -> dict[str, Any]:
    """A whole (non-streamed) response object; ``usage.epd`` is an extra property. With ``return_token_ids``
    each choice has ``token_ids``, and ``prompt_token_ids`` is in each choice or at the top level (vLLM's)."""
    prompt_ids = {"prompt_token_ids": _TOKEN_IDS}
    top = {} if prompt_ids_in_choice else prompt_ids
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            **top,
            "id": {"type": "string"},
            "object": {"const": object_name},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["index", "finish_reason", *choice],
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        "finish_reason": _FINISH_REASON,
                        "token_ids": _TOKEN_IDS,
                        **(prompt_ids if prompt_ids_in_choice else {}),
                        **choice,
                    },
                },
            },
            "usage": {"$ref": _REF.format(model="Usage")},
        },
    }


_CHAT_COMPLETION = _completion(
    "chat.completion",
    {
        "message": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
        }
    },
    prompt_ids_in_choice=False,
)
_TEXT_COMPLETION = _completion("text_completion", {"text": {"type": "string"}}, prompt_ids_in_choice=True)

_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "max_model_len": {"type": "integer"},
    },
}
_MODEL_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}},
}
_HEALTH = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"enum": ["ok", "unavailable"]}},
}

_ERROR_STATUSES = {
    "400": "Invalid request (never echoes input)",
    "401": "Missing or wrong API key (when one is configured; /metrics: also always with --metrics-require-token "
    "and no key, whose scrapes go to --metrics-port)",
    "404": "Unknown model",
    "413": "Body over the size limit",
    "415": "Body not sent as application/json",
    "429": "Over this client's request or token limit (when configured); see Retry-After",
    "500": "Internal error",
    "503": "At capacity or no backend available; see Retry-After",
    "504": "The request's deadline passed",
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _limits(max_tokens_limit: int, max_n: int) -> dict[str, dict[str, Any]]:
    """Field schemas narrowed to what this server accepts: its configured limits, and the
    one value each unsupported OpenAI parameter may take (others are refused with a 400)."""
    tokens = _nullable({"type": "integer", "minimum": 1, "maximum": max_tokens_limit})
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    token_id = {"type": "integer", "minimum": 0}
    return {
        "max_tokens": tokens,
        "max_completion_tokens": tokens,
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": max_tokens_limit},
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": max_n}),
        "stop": {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]},
        "stop_token_ids": _nullable(
            {
                "type": "array",
                "maxItems": MAX_STOP_STRINGS,
                "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
            }
        ),
        "logit_bias": _nullable(
            {
                "type": "object",
                "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,9})$"},
                "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
            }
        ),
        "tools": _nullable({"type": "array", "maxItems": 0}),
        "tool_choice": _nullable({"const": "none"}),
        # Structured outputs: the bounds structured.py checks (PD judges whether a constraint compiles).
        "guided_regex": _nullable({"type": "string", "minLength": 1}),
        "guided_choice": _nullable(
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_CHOICES}
        ),
        "echo": {"const": False},
        "suffix": _nullable({"const": ""}),
        "best_of": _nullable({"const": 1}),
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": token_id, "minItems": 1},
                _one({"type": "string"}),
                _one({"type": "array", "items": token_id, "minItems": 1}),
            ]
        },
    }


def _no_op(values: tuple[Any, ...]) -> dict[str, Any]:
    """The values a ``NOT_IMPLEMENTED`` field is accepted with (type-strict: ``0`` is not ``false``)."""

    def one(value: Any) -> dict[str, Any]:
        if value is None:
            return {"type": "null"}
        if isinstance(value, list | dict) and not value:
            kind = "array" if isinstance(value, list) else "object"
            return {"type": kind, "maxItems" if kind == "array" else "maxProperties": 0}
        kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}[type(value)]
        return {"type": kind, "const": value}

    return {"anyOf": [one(value) for value in values]}


def _one(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item, "minItems": 1, "maxItems": 1}


# A message's content may be null (or absent) on assistant turns only.
_CONTENT_REQUIRED = {
    "if": {"properties": {"role": {"const": "assistant"}}},
    "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(model=name)}


def _errors(*statuses: str) -> dict[str, Any]:
    return {status: {"description": _ERROR_STATUSES[status], "content": _json(_ref("Error"))} for status in statuses}


def _generation(model: type[BaseModel], response: str) -> dict[str, Any]:
    """Request body and responses of a generation endpoint (JSON, or SSE with ``stream: true``)."""
    return {
        "requestBody": {"required": True, "content": _json(_ref(model.__name__))},
        "responses": {
            "200": {
                "description": "The completion; with stream=true, server-sent events ending with [DONE]",
                "headers": {
                    IGNORED_FIELDS_HEADER: {
                        "description": "The unknown request fields that were ignored, by path (bounded)",
                        "schema": {"type": "string", "maxLength": MAX_HEADER_CHARS},
                    }
                },
                "content": {**_json(_ref(response)), "text/event-stream": {"schema": _SSE_EVENT}},
            },
            **_errors("400", "401", "404", "413", "415", "429", "500", "503", "504"),
        },
    }


def openapi_document(app: FastAPI, *, max_tokens_limit: int, max_n: int) -> dict[str, Any]:
    """The document served at ``/openapi.json`` (built once per app; the limits: ``--max-tokens-limit``, ``--max-n``)."""
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    limits = _limits(max_tokens_limit, max_n)
    for model in (ChatCompletionRequest, CompletionRequest):
        body = model.model_json_schema(ref_template=_REF)
        schemas.update(body.pop("$defs", {}))
        properties = body["properties"]
        properties.update({name: limit for name, limit in limits.items() if name in properties})
        schemas[model.__name__] = body
    schemas["ChatMessage"].update(_CONTENT_REQUIRED)
    # Fields this server knows and does not implement: described with the only values it accepts. Any other
    # property is ignored (and named in X-EPD-Ignored-Fields), so the schemas leave additionalProperties open.
    for declared, fields in NOT_IMPLEMENTED.items():
        properties = schemas[declared.__name__].setdefault("properties", {})
        properties.update({name: _no_op(values) for name, values in fields.items() if name not in properties})
    schemas.update(Error=_ERROR, Usage=_USAGE, ChatCompletion=_CHAT_COMPLETION, TextCompletion=_TEXT_COMPLETION)
    paths = document["paths"]
    paths["/v1/chat/completions"]["post"].update(_generation(ChatCompletionRequest, "ChatCompletion"))
    paths["/v1/completions"]["post"].update(_generation(CompletionRequest, "TextCompletion"))
    paths["/v1/models"]["get"]["responses"] = {
        "200": {"description": "The served model", "content": _json(_MODEL_LIST)},
        **_errors("401"),
    }
    paths["/v1/models/{model_id}"]["get"].update(
        parameters=[{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        responses={
            "200": {"description": "The served model", "content": _json(_MODEL)},
            **_errors("401", "404"),
        },
    )
    paths["/health"]["get"]["responses"] = {
        "200": {"description": "A PD (and an encoder, if configured) is ready", "content": _json(_HEALTH)},
        "503": {"description": "Not ready", "content": _json(_HEALTH)},
    }
    paths["/health/live"]["get"]["responses"] = {
        "200": {"description": "The proxy's event loop answers (backends not consulted): the liveness probe"},
    }
    paths["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors("401"),
        "404": {"description": "Served on the proxy's --metrics-port instead", "content": _json(_ref("Error"))},
    }
    app.openapi_schema = document
    return document

"""Structured-output fields -> ``epd.v1.StructuredOutput``, with the cheap checks the proxy can make.

Five spellings of one thing: OpenAI's ``response_format`` (``json_object``,
``json_schema``; chat only) and vLLM's ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``), ``guided_json``,
``guided_regex`` and ``guided_choice`` (both endpoints). A request may use one
of them. The proxy imports no grammar library (the one PD uses imports
torch), so it checks shapes and sizes only; PD compiles the constraint and
answers INVALID_ARGUMENT (a 400 here) for one that does not compile. Messages
never quote the constraint.
"""

from __future__ import annotations

import json
from typing import Any

from services.common.pb import epd_pb2
from services.proxy.errors import RequestError
from services.proxy.openai.schemas import ChatCompletionRequest, StructuredOutputs, _SamplingFields

MAX_CONSTRAINT_BYTES = 64 * 1024  # PD's bound too (sampling_convert.MAX_CONSTRAINT_BYTES)
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 32  # nesting of objects and arrays in a schema document
JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_STRUCTURED_OUTPUT_KEYS = ("json_", "regex", "choice", "grammar", "json_object")


def structured_output(body: _SamplingFields) -> epd_pb2.StructuredOutput | None:
    """The request's constraint on the wire, or None; 400 (``RequestError``) for a malformed one.

    At most one of the fields may be set; ``min_tokens`` cannot be combined
    with any (a complete output allows only a stop token, which it forbids).
    """
    given = _given(body)
    if not given:
        return None
    if len(given) > 1:
        raise RequestError("Only one structured output constraint may be given.", given[1][0])
    param, build = given[0]
    if body.min_tokens:
        raise RequestError("min_tokens cannot be combined with a structured output.", "min_tokens")
    return build(param)


def _given(body: _SamplingFields) -> list[tuple[str, Any]]:
    """``(param, builder)`` of every constraint field that is set, in a fixed order."""
    given: list[tuple[str, Any]] = []
    if isinstance(body, ChatCompletionRequest) and body.response_format is not None:
        chat, response_format = body, body.response_format
        if response_format.type != "text" or response_format.json_schema is not None:
            given.append(("response_format", lambda param: _response_format(chat)))
    if body.structured_outputs is not None:
        outputs = body.structured_outputs
        given.append(("structured_outputs", lambda param: _structured_outputs(outputs)))
    if body.guided_json is not None:
        given.append(("guided_json", lambda param: _json_schema(body.guided_json, param)))
    if body.guided_regex is not None:
        given.append(("guided_regex", lambda param: _text("regex", body.guided_regex, param)))
    if body.guided_choice is not None:
        given.append(("guided_choice", lambda param: _choice(body.guided_choice, param)))
    return given


def _response_format(body: ChatCompletionRequest) -> epd_pb2.StructuredOutput:
    response_format = body.response_format
    assert response_format is not None
    if response_format.type == "text":
        raise RequestError("json_schema belongs to the json_schema response format.", "response_format.json_schema")
    if response_format.type == "json_object":
        if response_format.json_schema is not None:
            raise RequestError("json_schema belongs to the json_schema response format.", "response_format.json_schema")
        return epd_pb2.StructuredOutput(json_object=True)
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise RequestError("The json_schema response format needs json_schema.schema.", "response_format.json_schema")
    return _json_schema(response_format.json_schema.schema_, "response_format.json_schema.schema")


def _structured_outputs(outputs: StructuredOutputs) -> epd_pb2.StructuredOutput:
    keys = [key for key in _STRUCTURED_OUTPUT_KEYS if getattr(outputs, key) is not None]
    if len(keys) != 1:
        raise RequestError("structured_outputs must set exactly one constraint.", "structured_outputs")
    key = keys[0]
    param = f"structured_outputs.{key.rstrip('_')}"
    if key == "json_":
        return _json_schema(outputs.json_, param)
    if key == "choice":
        return _choice(outputs.choice, param)
    if key == "json_object":
        if outputs.json_object is not True:
            raise RequestError("structured_outputs.json_object must be true.", param)
        return epd_pb2.StructuredOutput(json_object=True)
    return _text(key, getattr(outputs, key), param)


def _json_schema(schema: dict[str, Any] | str | None, param: str) -> epd_pb2.StructuredOutput:
    """A schema given as an object or as JSON text (vLLM takes both), checked and serialized."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise RequestError("The JSON schema is not valid JSON.", param) from None
    if not isinstance(schema, dict):
        raise RequestError("The JSON schema must be a JSON object.", param)
    check_schema(schema, param)
    text = json.dumps(schema, separators=(",", ":"))
    _check_size(text, param)
    return epd_pb2.StructuredOutput(json_schema=text)


def check_schema(schema: dict[str, Any], param: str) -> None:
    """Structural checks a schema must pass before PD compiles it: bounded nesting, and a
    top-level ``type`` that names JSON types. What else a schema may say is the compiler's to judge."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not kinds and kind is not None or any(not isinstance(k, str) or k not in JSON_TYPES for k in kinds):
        raise RequestError("The JSON schema's type must name JSON types.", param)
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:  # iterative: a deep document must not exhaust the proxy's stack
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestError(f"The JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels.", param)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _text(kind: str, value: str | None, param: str) -> epd_pb2.StructuredOutput:
    """A regex or an EBNF grammar: non-empty and bounded (PD parses it)."""
    if not value:
        raise RequestError(f"The {kind} must not be empty.", param)
    _check_size(value, param)
    return epd_pb2.StructuredOutput(regex=value) if kind == "regex" else epd_pb2.StructuredOutput(grammar=value)


def _choice(choices: list[str] | None, param: str) -> epd_pb2.StructuredOutput:
    if not choices or len(choices) > MAX_CHOICES:
        raise RequestError(f"A choice constraint needs 1 to {MAX_CHOICES} strings.", param)
    _check_size(json.dumps(choices), param)
    return epd_pb2.StructuredOutput(choice=epd_pb2.ChoiceList(choices=choices))


def _check_size(text: str, param: str) -> None:
    if len(text.encode()) > MAX_CONSTRAINT_BYTES:
        raise RequestError(f"The constraint is larger than {MAX_CONSTRAINT_BYTES} bytes.", param)

"""Structured-output fields at the proxy: each spelling on the wire, and every refusal (400, naming the field,
never quoting the constraint)."""

from __future__ import annotations

import json

import pytest

from services.common.pb import epd_pb2
from services.proxy.errors import RequestError, UnknownFieldError
from services.proxy.openai.fields import check_fields
from services.proxy.openai.sampling import check_supported, sampling_params
from services.proxy.openai.schemas import ChatCompletionRequest, CompletionRequest
from services.proxy.openai.structured import MAX_CHOICES, MAX_CONSTRAINT_BYTES, MAX_SCHEMA_DEPTH, structured_output

SECRET = "zebra-secret-42"
SCHEMA = {"type": "object", "properties": {SECRET: {"enum": [1, 2]}}, "required": [SECRET]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


def _deep_schema(depth: int) -> dict:
    """Arrays of arrays: ``depth`` + 1 levels of objects (one past the limit)."""
    schema: dict = {"type": "array"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi."}], **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hi.", **fields})


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (chat(), None),
        (chat(response_format={"type": "text"}), None),
        (chat(response_format={"type": "json_object"}), epd_pb2.StructuredOutput(json_object=True)),
        (
            chat(
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
            ),
            epd_pb2.StructuredOutput(json_schema=SCHEMA_TEXT),
        ),
        (chat(guided_json=SCHEMA), epd_pb2.StructuredOutput(json_schema=SCHEMA_TEXT)),
        (completion(guided_json=json.dumps(SCHEMA)), epd_pb2.StructuredOutput(json_schema=SCHEMA_TEXT)),
        (completion(guided_regex="[ab]+"), epd_pb2.StructuredOutput(regex="[ab]+")),
        (
            completion(guided_choice=["x", "y"]),
            epd_pb2.StructuredOutput(choice=epd_pb2.ChoiceList(choices=["x", "y"])),
        ),
        (chat(structured_outputs={"json": SCHEMA}), epd_pb2.StructuredOutput(json_schema=SCHEMA_TEXT)),
        (chat(structured_outputs={"regex": "a+"}), epd_pb2.StructuredOutput(regex="a+")),
        (
            chat(structured_outputs={"choice": ["x"]}),
            epd_pb2.StructuredOutput(choice=epd_pb2.ChoiceList(choices=["x"])),
        ),
        (chat(structured_outputs={"grammar": 'root ::= "a"'}), epd_pb2.StructuredOutput(grammar='root ::= "a"')),
        (chat(structured_outputs={"json_object": True}), epd_pb2.StructuredOutput(json_object=True)),
    ],
)
def test_each_spelling_reaches_the_wire(body, expected):
    check_supported(body)
    assert structured_output(body) == expected
    params = sampling_params(body, 8)
    assert params.HasField("structured_output") == (expected is not None)
    if expected is not None:
        assert params.structured_output == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
        (completion(guided_json=SCHEMA, structured_outputs={"regex": "a"}), "guided_json"),
        (chat(guided_json=SCHEMA, min_tokens=1, max_tokens=4), "min_tokens"),
        (chat(response_format={"type": "text", "json_schema": {"name": SECRET}}), "response_format.json_schema"),
        (chat(response_format={"type": "json_object", "json_schema": {"name": SECRET}}), "response_format.json_schema"),
        (chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": SECRET}}), "response_format.json_schema"),
        (chat(structured_outputs={}), "structured_outputs"),
        (chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
        (chat(structured_outputs={"json_object": False}), "structured_outputs.json_object"),
        (chat(structured_outputs={"json": "{" + SECRET}), "structured_outputs.json"),
        (chat(guided_json=json.dumps([SECRET])), "guided_json"),
        (chat(guided_json={"type": SECRET}), "guided_json"),
        (chat(guided_json={"type": ["object", SECRET]}), "guided_json"),
        (chat(guided_json={"type": []}), "guided_json"),
        (chat(guided_json=_deep_schema(MAX_SCHEMA_DEPTH)), "guided_json"),
        (chat(guided_json={"description": SECRET * (MAX_CONSTRAINT_BYTES // len(SECRET))}), "guided_json"),
        (chat(guided_regex=""), "guided_regex"),
        (chat(structured_outputs={"grammar": ""}), "structured_outputs.grammar"),
        (chat(guided_choice=[]), "guided_choice"),
        (chat(guided_choice=[SECRET] * (MAX_CHOICES + 1)), "guided_choice"),
    ],
)
def test_malformed_constraints_are_refused_by_field(body, param):
    with pytest.raises(RequestError) as refused:
        check_supported(body)
    assert refused.value.param == param
    assert SECRET not in str(refused.value)


def test_a_schema_at_the_depth_limit_passes():
    check_supported(chat(guided_json=_deep_schema(MAX_SCHEMA_DEPTH - 1)))


def test_unknown_keys_inside_structured_outputs_and_json_schema_are_named_by_path():
    body = chat(structured_outputs={"regex": "a", "whitespace_pattern": SECRET})
    assert check_fields(body) == ["structured_outputs.whitespace_pattern"]
    with pytest.raises(UnknownFieldError) as refused:
        check_fields(body, ignore_unknown=False)
    assert refused.value.param == "structured_outputs.whitespace_pattern"
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "colour": 1}})
    assert check_fields(body) == ["response_format.json_schema.colour"]
    with pytest.raises(UnknownFieldError) as refused:
        check_fields(body, ignore_unknown=False)
    assert refused.value.param == "response_format.json_schema.colour"

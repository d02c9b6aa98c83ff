"""fields.py: undeclared fields judged by name and value; the header's bounds; the docs' table kept true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.proxy.errors import UnknownFieldError, UnsupportedFeatureError
from services.proxy.openai.fields import (
    EXTENSIONS,
    IGNORED_FIELDS_HEADER,
    MAX_HEADER_CHARS,
    NOT_IMPLEMENTED,
    check_fields,
    ignored_fields_header,
)
from services.proxy.openai.schemas import ChatCompletionRequest, CompletionRequest

REQUEST_FIELDS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "api" / "request-fields.md"


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(("field", "value"), [("store", 0), ("store", None), ("parallel_tool_calls", 1)])
def test_a_no_op_value_must_have_the_no_op_type(field, value):
    if value is None:
        assert check_fields(chat(**{field: value})) == []
        return
    with pytest.raises(UnsupportedFeatureError):  # 0 is not false, 1 is not true
        check_fields(chat(**{field: value}))


def test_unknown_fields_are_listed_once_without_indexes_or_refused_when_strict():
    body = chat(messages=[{"role": "user", "content": "a", "x": 1}, {"role": "user", "content": "b", "x": 2}], y=3)
    assert check_fields(body) == ["y", "messages.x"]
    assert check_fields(CompletionRequest.model_validate({"prompt": "p"})) == []
    with pytest.raises(UnknownFieldError) as refused:
        check_fields(body, ignore_unknown=False)
    assert refused.value.param == "y" and refused.value.code == "unknown_parameter"


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [
        (CompletionRequest, "truncate_prompt_tokens", 5),
        (CompletionRequest, "use_beam_search", True),
        (CompletionRequest, "length_penalty", 2.0),
        (ChatCompletionRequest, "continue_final_message", True),
        (ChatCompletionRequest, "add_generation_prompt", False),
        (ChatCompletionRequest, "echo", True),
        (ChatCompletionRequest, "regex", "a+"),
    ],
)
def test_a_peer_field_we_do_not_honour_is_refused_whatever_the_unknown_policy(model, field, value):
    base = {"prompt": "p"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(UnsupportedFeatureError) as refused:
        check_fields(model.model_validate({**base, field: value}))
    assert refused.value.param == field
    no_op = NOT_IMPLEMENTED[model][field][-1]
    assert check_fields(model.model_validate({**base, field: no_op})) == []


def test_the_header_is_bounded_in_names_and_characters():
    assert ignored_fields_header([]) == {}
    assert ignored_fields_header(["a", "b"]) == {IGNORED_FIELDS_HEADER: "a,b"}
    long = [f"{'n' * 60}{i:02d}" for i in range(12)]
    value = ignored_fields_header(long)[IGNORED_FIELDS_HEADER]
    assert len(value) <= MAX_HEADER_CHARS and value.endswith(",...") and value.split(",")[0] == long[0]


def test_the_docs_table_names_every_extension_and_unimplemented_field():
    text = REQUEST_FIELDS_PAGE.read_text()
    table = text[text.index("| Field | Endpoint | Status |") :]
    table = table[: table.index("\n\n")]
    named = set(re.findall(r"[`.]([a-z_]+)", table))
    assert set(EXTENSIONS) <= named
    for fields in NOT_IMPLEMENTED.values():
        assert set(fields) <= named

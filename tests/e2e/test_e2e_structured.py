"""Structured outputs through the whole cluster (proxy -> encoder -> PD), on the tiny LLaVA checkpoint.

Twenty requests with twenty schemas (nested objects, enums, arrays, numbers,
strings), with and without images, streaming and not, greedy and sampled,
spelled each way a client may (``response_format`` through the official
``openai`` SDK; ``structured_outputs`` / ``guided_json`` as its
``extra_body``; the completions endpoint), sent at once so that constrained
and free rows share steps. Every output parses and validates with
``jsonschema``. The schemas bound what a random-weight model could otherwise
never close (``maxLength``, bounded numbers, ``maxItems``).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from cluster_support import InProcessCluster
from oracle_support import make_image, user_message

MAX_TOKENS = 160
SECRET = "zebra-secret-42"


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


_NAME = {"type": "string", "maxLength": 10}
_SMALL = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS = [
    _object({"color": {"enum": ["red", "green", "blue"]}}),
    _object({"ok": {"type": "boolean"}, "count": _SMALL}),
    _object({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _object({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    _object({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    _object({"point": _object({"x": _SMALL, "y": _SMALL})}),
    _object({"user": _object({"name": _NAME, "admin": {"type": "boolean"}}), "level": {"enum": [1, 2, 3]}}),
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
    _object({"matrix": {"type": "array", "items": {"type": "array", "items": _SMALL, "maxItems": 2}, "maxItems": 2}}),
    _object({"status": {"const": "done"}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}),
    _object({"a": {"type": "boolean"}, "b": {"enum": [1, 2]}}, required=[]),
    _object({"id": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    _object({"value": {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9}]}}),
    _object({"items": {"type": "array", "items": _object({"k": {"enum": ["x", "y"]}, "v": _SMALL}), "maxItems": 2}}),
    _object({"temperature": {"type": "number", "minimum": -50, "maximum": 50}, "unit": {"enum": ["C", "F"]}}),
    _object({"nothing": {"type": "null"}, "flag": {"type": "boolean"}}),
    _object({"words": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 2}}),
    _object({"deep": _object({"deeper": _object({"deepest": {"enum": [True, False]}})})}),
    _object({"grade": {"enum": ["A", "B", "C", "D"]}, "passed": {"type": "boolean"}, "points": _SMALL}),
    {"enum": ["yes", "no", "maybe"]},
]

# How each request spells its constraint, and where it goes.
SPELLINGS = ["response_format", "structured_outputs", "guided_json", "completions"]


@pytest.fixture(scope="module")
def cluster(build_model):
    cluster = InProcessCluster(str(build_model("tiny"))).start()
    yield cluster
    cluster.stop()


def _send(client: openai.OpenAI, index: int, schema: dict) -> tuple[str, str]:
    """Request ``index``: its spelling, image, streaming and sampling follow from the index. Returns
    (text, finish_reason)."""
    spelling = SPELLINGS[index % len(SPELLINGS)]
    stream = index % 3 == 0
    greedy = (index + index // 4) % 2 == 0  # each spelling greedy and sampled
    sampling = {"temperature": 0.0} if greedy else {"temperature": 1.0, "seed": index}
    text = f"Reply in JSON, request {index}."
    if spelling == "completions":
        body = {"guided_json": schema} if index % 8 < 4 else {"structured_outputs": {"json": json.dumps(schema)}}
        reply = client.completions.create(
            model="tiny", prompt=text, max_tokens=MAX_TOKENS, stream=stream, extra_body=body, **sampling
        )
        return _collect(reply, stream, lambda choice: choice.text)
    images = [make_image(index)] if (index // 4) % 2 == 0 else []  # each chat spelling with and without
    kwargs: dict = {}
    if spelling == "structured_outputs":
        kwargs["extra_body"] = {"structured_outputs": {"json": schema}}
    elif spelling == "guided_json":
        kwargs["extra_body"] = {"guided_json": schema}
    else:
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}}
    reply = client.chat.completions.create(
        model="tiny",
        messages=[user_message(text, images)],
        max_tokens=MAX_TOKENS,
        stream=stream,
        **sampling,
        **kwargs,
    )
    return _collect(reply, stream, lambda choice: choice.delta.content if stream else choice.message.content)


def _collect(reply, stream: bool, text_of) -> tuple[str, str]:
    if not stream:
        return text_of(reply.choices[0]), reply.choices[0].finish_reason
    parts, finish_reason = [], None
    for chunk in reply:
        for choice in chunk.choices:
            parts.append(text_of(choice) or "")
            finish_reason = choice.finish_reason or finish_reason
    return "".join(parts), finish_reason


def test_twenty_schemas_parse_and_validate(cluster):
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=300)
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        replies = list(pool.map(lambda item: _send(client, *item), enumerate(SCHEMAS)))
    for index, (schema, (text, finish_reason)) in enumerate(zip(SCHEMAS, replies)):
        assert finish_reason == "stop", (index, text)
        jsonschema.validate(json.loads(text), schema)
    assert cluster.leaks() == {}


def test_json_object_regex_and_choice(cluster):
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=300)
    messages = [user_message("Anything.", [make_image(7)])]
    # Any object: unbounded keys and strings, which a random-weight model mostly does not close within
    # max_tokens ("length", the documented outcome). Every output that did end must be an object.
    finished = []
    for seed in range(8):
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=MAX_TOKENS,
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            finished.append(json.loads(choice.message.content))
    assert finished and all(isinstance(value, dict) for value in finished)
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, extra_body={"guided_regex": "[a-c]{2,4}-[0-9]"}
    )
    assert re.fullmatch("[a-c]{2,4}-[0-9]", reply.choices[0].message.content)
    choices = ['say "hi"', "naïve\\path", "no"]
    for stream in (False, True):
        reply = client.completions.create(
            model="tiny", prompt="Pick.", max_tokens=MAX_TOKENS, stream=stream, extra_body={"guided_choice": choices}
        )
        text, finish_reason = _collect(reply, stream, lambda choice: choice.text)
        assert text in choices and finish_reason == "stop"
    assert cluster.leaks() == {}


def test_a_schema_that_does_not_compile_is_a_400_that_does_not_echo_it(cluster):
    schema = {"type": "object", "properties": {SECRET: {"$ref": f"#/definitions/{SECRET}"}}, "required": [SECRET]}
    body = {
        "messages": [{"role": "user", "content": "Hi."}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "broken", "schema": schema}},
    }
    reply = httpx.post(cluster.base_url + "/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert SECRET not in reply.text
    assert cluster.leaks() == {}


@pytest.mark.timeout(300)
def test_long_strings_compile_and_a_slow_constraint_is_a_400_within_the_bound(cluster):
    """``maxLength`` 4000 and 9000 took 47 s and over 200 s to compile when they were rewritten into
    patterns, and every other constrained request waited behind them; a pattern xgrammar still compiles
    that slowly is refused at PD's bound (``--grammar-compile-timeout-s``, 5 s), and the constrained
    request that follows is served as usual."""

    def ask(schema: dict) -> httpx.Response:
        body = {
            "messages": [{"role": "user", "content": "Hi."}],
            "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}},
        }
        return httpx.post(cluster.base_url + "/chat/completions", json=body, timeout=240)

    for max_length in (4000, 9000):
        reply = ask(_object({"text": {"type": "string", "maxLength": max_length}}))
        assert reply.status_code == 200, reply.text
    started = time.monotonic()
    reply = ask({"type": "string", "pattern": '^[^"]{0,8000}$'})  # about a minute to compile here
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert time.monotonic() - started < 60
    started = time.monotonic()
    assert ask(_object({"name": _NAME, "n": _SMALL})).status_code == 200
    assert time.monotonic() - started < 30  # not behind the refused compile
    assert cluster.leaks() == {}

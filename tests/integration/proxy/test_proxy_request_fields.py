"""Every request field is honoured, refused or ignored and named: unknown and unimplemented fields, the strict flag,
min_tokens, penalties, min_p, logit_bias, detokenizer options."""

from __future__ import annotations

import logging

import openai
import pytest
from proxy_doubles import openai_client, png_data_url

SECRET = "zebra-secret-42"
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
COMPLETION = {"prompt": "Once", "max_tokens": 8}
BODIES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
IGNORED = "X-EPD-Ignored-Fields"


def assert_refused(reply, code: str, param: str | None) -> dict:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert SECRET not in reply.text and IGNORED not in reply.headers
    return error


def image_part(**extra) -> dict:
    return {"type": "image_url", "image_url": {"url": png_data_url(), **extra}}


@pytest.mark.parametrize(("path", "body"), BODIES)
async def test_an_unknown_top_level_field_is_ignored_and_named(cluster_factory, path, body):
    cluster = await cluster_factory()
    reply = await cluster.client.post(path, json={**body, "temprature": SECRET})
    assert reply.status_code == 200, reply.text
    assert reply.headers[IGNORED] == "temprature" and SECRET not in str(reply.headers)
    assert len(cluster.pd.generates) == 1


@pytest.mark.parametrize(
    ("message", "extra", "name"),
    [
        ({"role": "user", "content": "Hi.", "colour": SECRET}, {}, "messages.colour"),
        (
            {"role": "user", "content": [{"type": "text", "text": "Hi.", "cache_control": SECRET}]},
            {},
            "messages.content.cache_control",
        ),
        (
            {"role": "user", "content": [{"type": "text", "text": "Look."}, image_part(uuid=SECRET)]},
            {},
            "messages.content.image_url.uuid",
        ),
        (
            {"role": "user", "content": [{"type": "text", "text": "Look."}, {**image_part(), "modalities": "x"}]},
            {},
            "messages.content.modalities",  # SGLang's vision tests send it on every image part
        ),
        (CHAT["messages"][0], {"response_format": {"type": "text", "strict": SECRET}}, "response_format.strict"),
        (CHAT["messages"][0], {"stream": True, "stream_options": {"usage": SECRET}}, "stream_options.usage"),
    ],
    ids=["message", "text_part", "image_url", "image_part", "response_format", "stream_options"],
)
async def test_an_unknown_nested_key_is_ignored_and_named_by_path(cluster_factory, message, extra, name):
    cluster = await cluster_factory()
    reply = await cluster.client.post("/v1/chat/completions", json={**CHAT, "messages": [message], **extra})
    assert reply.status_code == 200, reply.text
    assert reply.headers[IGNORED] == name
    assert len(cluster.pd.generates) == 1


async def test_unknown_fields_at_every_level_with_an_image_are_served(cluster_factory):
    """vLLM's test_extra_fields_allowed and its unknown keys on an image part; SGLang's ``modalities``."""
    cluster = await cluster_factory()
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": png_data_url(), "uuid": SECRET}, "modalities": "multi-images"},
        ],
        "extra_field": SECRET,
    }
    reply = await cluster.client.post(
        "/v1/chat/completions", json={**CHAT, "messages": [message], "top_level_x": 1, "return_token_ids": True}
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers[IGNORED] == (
        "top_level_x,messages.extra_field,messages.content.modalities,messages.content.image_url.uuid"
    )
    [generate] = cluster.pd.generates
    assert reply.json()["prompt_token_ids"] == list(generate.prompt_token_ids)


async def test_a_key_that_is_no_plain_name_is_ignored_without_repeating_it(cluster_factory):
    cluster = await cluster_factory()
    message = {"role": "user", "content": "Hi.", f"{SECRET} with spaces": 1}
    reply = await cluster.client.post("/v1/chat/completions", json={**CHAT, "messages": [message]})
    assert reply.status_code == 200 and reply.headers[IGNORED] == "messages.?"
    assert SECRET not in str(reply.headers)


@pytest.mark.parametrize(("path", "body"), BODIES)
async def test_the_strict_flag_refuses_unknown_fields_by_name(cluster_factory, path, body):
    cluster = await cluster_factory(ignore_unknown_fields=False)
    reply = await cluster.client.post(path, json={**body, "temprature": SECRET})
    error = assert_refused(reply, "unknown_parameter", "temprature")
    assert error["message"] == "Unknown field temprature."
    message = {"role": "user", "content": [{"type": "text", "text": "Hi.", "cache_control": SECRET}]}
    reply = await cluster.client.post("/v1/chat/completions", json={**CHAT, "messages": [message]})
    assert_refused(reply, "unknown_parameter", "messages[0].content[0].cache_control")
    message = {"role": "user", "content": "Hi.", f"{SECRET} with spaces": 1}
    reply = await cluster.client.post("/v1/chat/completions", json={**CHAT, "messages": [message]})
    assert_refused(reply, "unknown_parameter", "messages[0]")
    reply = await cluster.client.post("/v1/completions", json={**COMPLETION, "x" * 65: 1})
    assert_refused(reply, "unknown_parameter", None)
    assert cluster.pd.generates == []


async def test_the_sdk_sees_unknown_fields_ignored_and_peer_fields_we_do_not_honour_refused(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        reply = await client.chat.completions.with_raw_response.create(
            model="tiny-llava", messages=CHAT["messages"], max_tokens=3, extra_body={"best_of_n": SECRET}
        )
        assert reply.headers[IGNORED] == "best_of_n"
        for field, value in (("truncate_prompt_tokens", 2), ("use_beam_search", True), ("regex", "a+")):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.completions.create(
                    model="tiny-llava", prompt="Once", max_tokens=3, extra_body={field: value}
                )
            # a vLLM (or SGLang) field this server does not honour: ignoring it would change the answer
            assert (caught.value.body["code"], caught.value.body["param"]) == ("unsupported_parameter", field)
        served = await client.completions.create(
            model="tiny-llava", prompt="Once", max_tokens=3, extra_body={"use_beam_search": False, "priority": 0}
        )
        assert served.choices[0].text is not None
    finally:
        await client.close()
    assert len(cluster.pd.generates) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store", True),
        ("reasoning_effort", "low"),
        ("metadata", {"k": SECRET}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("service_tier", "flex"),
        ("prediction", {"type": "content", "content": SECRET}),
        ("web_search_options", {}),
        ("verbosity", "low"),
        ("functions", [{"name": "f"}]),
    ],
)
async def test_the_sdk_sees_openai_fields_we_do_not_implement_refused(cluster_factory, field, value):
    cluster = await cluster_factory(http=True)  # refused, not ignored
    client = openai_client(cluster)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="tiny-llava", messages=CHAT["messages"], max_tokens=3, **{field: value}
            )
    finally:
        await client.close()
    body = caught.value.body
    assert (body["code"], body["param"], body["message"]) == (
        "unsupported_parameter",
        field,
        f"{field} is not supported.",
    )
    assert SECRET not in str(body)
    assert cluster.pd.generates == []


async def test_the_sdk_defaults_and_no_op_values_are_served(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        reply = await client.chat.completions.create(
            model="tiny-llava",
            messages=[{"role": "system", "content": "Be brief."}, *CHAT["messages"]],
            max_completion_tokens=3,
            n=1,
            seed=7,
            user="u-1",
            safety_identifier="s-1",
            prompt_cache_key="greeting",
            temperature=0.5,
            top_p=0.9,
            stop=["\n\n"],
            logprobs=True,
            top_logprobs=2,
            presence_penalty=0,
            frequency_penalty=0,
            store=False,
            modalities=["text"],
            service_tier="auto",
            parallel_tool_calls=False,
            response_format={"type": "text"},
            metadata={},
        )
        # The SDK's own message object goes back as history (refusal, tool_calls, ... as the reply had them).
        history = [*CHAT["messages"], reply.choices[0].message, {"role": "user", "content": "Again."}]
        again = await client.chat.completions.create(model="tiny-llava", messages=history, max_tokens=3)
        stream = await client.chat.completions.create(
            model="tiny-llava",
            messages=CHAT["messages"],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
        )
        chunks = [chunk async for chunk in stream]
        completion = await client.completions.create(
            model="tiny-llava", prompt="Once", max_tokens=3, n=1, seed=1, user="u", best_of=1, echo=False, suffix=None
        )
    finally:
        await client.close()
    assert reply.choices[0].finish_reason and again.choices[0].message.content is not None
    assert chunks[-1].usage is not None and completion.choices[0].text is not None
    assert len(cluster.pd.generates) == 4


async def test_assistant_history_with_tool_calls_or_a_refusal_is_refused(cluster_factory):
    cluster = await cluster_factory()
    for key, value in (("tool_calls", [{"id": SECRET}]), ("refusal", SECRET), ("tool_call_id", SECRET)):
        history = [*CHAT["messages"], {"role": "assistant", "content": "Hi.", key: value}]
        reply = await cluster.client.post("/v1/chat/completions", json={**CHAT, "messages": history})
        assert_refused(reply, "unsupported_parameter", f"messages[1].{key}")
    assert cluster.pd.generates == []


async def test_include_obfuscation_true_is_refused(cluster_factory):
    cluster = await cluster_factory()
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}}
    reply = await cluster.client.post("/v1/chat/completions", json=body)
    assert_refused(reply, "unsupported_parameter", "stream_options.include_obfuscation")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), BODIES)
async def test_unknown_fields_are_ignored_named_and_logged_once(cluster_factory, caplog, path, body, stream):
    cluster = await cluster_factory()
    request = {**body, "stream": stream, "zeta": SECRET, "alpha": {"nested": SECRET}}
    if "messages" in body:
        request["messages"] = [
            {"role": "user", "content": [{"type": "text", "text": "Hi.", "cache_control": SECRET}], "colour": 1},
            {"role": "user", "content": "Again.", "colour": 2},
        ]
    with caplog.at_level(logging.INFO, logger="services.proxy.intake"):
        reply = await cluster.client.post(path, json=request)
    assert reply.status_code == 200, reply.text
    expected = "zeta,alpha" + (",messages.colour,messages.content.cache_control" if "messages" in body else "")
    assert reply.headers[IGNORED] == expected
    lines = [r.getMessage() for r in caplog.records if "ignored unknown fields" in r.getMessage()]
    assert lines == [f"{path}: ignored unknown fields {expected}"]
    assert SECRET not in caplog.text
    assert len(cluster.pd.generates) == 1


async def test_the_ignored_fields_header_is_bounded(cluster_factory):
    cluster = await cluster_factory()
    many = {f"field_{i:02d}": i for i in range(40)}
    reply = await cluster.client.post("/v1/completions", json={**COMPLETION, **many, "y" * 64: 1, "a b": 1})
    assert reply.status_code == 200, reply.text
    names = reply.headers[IGNORED].split(",")
    assert names == [f"field_{i:02d}" for i in range(16)] + ["..."]
    reply = await cluster.client.post("/v1/completions", json={**COMPLETION, f"{SECRET} x": 1, "y" * 64: 1})
    assert reply.headers[IGNORED] == "?," + "y" * 64  # a name that is no plain identifier is not repeated


async def test_without_unknown_fields_no_header_is_sent(cluster_factory):
    cluster = await cluster_factory()
    reply = await cluster.client.post("/v1/completions", json=COMPLETION)
    assert reply.status_code == 200 and IGNORED not in reply.headers


# ----------------------------------------------------------------------------- min_tokens


@pytest.mark.parametrize(("path", "body"), BODIES)
async def test_min_tokens_travels_to_pd(cluster_factory, path, body):
    cluster = await cluster_factory()
    reply = await cluster.client.post(path, json={**body, "min_tokens": 5})
    assert reply.status_code == 200, reply.text
    reply = await cluster.client.post(path, json={**body, "min_tokens": 8})  # equal to max_tokens
    assert reply.status_code == 200, reply.text
    reply = await cluster.client.post(path, json=body)
    assert [g.sampling.min_tokens for g in cluster.pd.generates] == [5, 8, 0]
    assert [g.sampling.HasField("min_tokens") for g in cluster.pd.generates] == [True, True, False]


@pytest.mark.parametrize(("path", "body"), BODIES)
@pytest.mark.parametrize("value", [9, -1, 2**32, "3", 2.5, None], ids=str)
async def test_min_tokens_outside_0_to_max_tokens_is_refused(cluster_factory, path, body, value):
    cluster = await cluster_factory()
    reply = await cluster.client.post(path, json={**body, "min_tokens": value})
    error = assert_refused(reply, "invalid_request", "min_tokens")
    if value == 9:
        assert error["message"] == "min_tokens must be at most max_tokens (8)."
    assert cluster.pd.generates == []


async def test_min_tokens_above_the_default_max_tokens_is_refused(cluster_factory):
    cluster = await cluster_factory(default_max_tokens=4)
    reply = await cluster.client.post("/v1/completions", json={"prompt": "Once", "min_tokens": 5})
    assert_refused(reply, "invalid_request", "min_tokens")
    reply = await cluster.client.post("/v1/completions", json={"prompt": "Once", "min_tokens": 4})
    assert reply.status_code == 200, reply.text


async def test_the_sdk_sends_min_tokens_in_extra_body(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        await client.chat.completions.create(
            model="tiny-llava", messages=CHAT["messages"], max_tokens=6, extra_body={"min_tokens": 6}
        )
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(
                model="tiny-llava", prompt="Once", max_tokens=2, extra_body={"min_tokens": 3}
            )
        assert (caught.value.body["code"], caught.value.body["param"]) == ("invalid_request", "min_tokens")
    finally:
        await client.close()
    assert [g.sampling.min_tokens for g in cluster.pd.generates] == [6]


# ----------------------------------------------------------------------------- penalties


async def test_the_sdk_sends_the_penalties_and_they_travel_to_pd(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        await client.chat.completions.create(
            model="tiny-llava",
            messages=CHAT["messages"],
            max_tokens=3,
            presence_penalty=0.5,
            frequency_penalty=-2,
            extra_body={"repetition_penalty": 1.3},
        )
        await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, frequency_penalty=2.0)
        await client.completions.create(
            model="tiny-llava", prompt="Once", max_tokens=3, extra_body={"repetition_penalty": 1e-300}
        )
    finally:
        await client.close()
    sent = [g.sampling for g in cluster.pd.generates]
    assert [(s.repetition_penalty, s.presence_penalty, s.frequency_penalty) for s in sent[:2]] == [
        (pytest.approx(1.3), 0.5, -2.0),
        (0.0, 0.0, 2.0),  # unset: PD's default, 1.0
    ]
    assert [s.HasField("repetition_penalty") for s in sent] == [True, False, True]
    assert sent[2].repetition_penalty > 0  # below float32's range: sent as its smallest positive, not 0


@pytest.mark.parametrize(("path", "body"), BODIES)
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 100.5),
        ("repetition_penalty", "1.2"),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", "high"),
    ],
    ids=str,
)
async def test_penalties_out_of_range_are_refused_by_name(cluster_factory, path, body, field, value):
    cluster = await cluster_factory()
    reply = await cluster.client.post(path, json={**body, field: value})
    assert_refused(reply, "invalid_request", field)
    assert cluster.pd.generates == []


async def test_the_sdk_sees_a_bad_penalty_refused(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="tiny-llava", messages=CHAT["messages"], max_tokens=3, extra_body={"repetition_penalty": 0}
            )
        assert (caught.value.body["code"], caught.value.body["param"]) == ("invalid_request", "repetition_penalty")
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, presence_penalty=-4)
        assert (caught.value.body["code"], caught.value.body["param"]) == ("invalid_request", "presence_penalty")
    finally:
        await client.close()
    assert cluster.pd.generates == []


# ----------------------------------------------------------------------------- min_p


async def test_the_sdk_sends_min_p_and_it_travels_to_pd(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        await client.chat.completions.create(
            model="tiny-llava", messages=CHAT["messages"], max_tokens=3, extra_body={"min_p": 0.1}
        )
        await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, extra_body={"min_p": 0})
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, extra_body={"min_p": 2})
        assert (caught.value.body["code"], caught.value.body["param"]) == ("invalid_request", "min_p")
    finally:
        await client.close()
    sent = [g.sampling for g in cluster.pd.generates]
    assert [s.min_p for s in sent] == [pytest.approx(0.1), 0.0]
    assert not sent[1].HasField("min_p")  # 0 is off: PD's default


@pytest.mark.parametrize(("path", "body"), BODIES)
@pytest.mark.parametrize("value", [-0.01, 1.01, "0.1", True], ids=str)
async def test_min_p_outside_0_to_1_is_refused(cluster_factory, path, body, value):
    cluster = await cluster_factory()
    reply = await cluster.client.post(path, json={**body, "min_p": value})
    assert_refused(reply, "invalid_request", "min_p")
    assert cluster.pd.generates == []


# ----------------------------------------------------------------------------- logit_bias


async def test_the_sdk_sends_logit_bias_and_it_travels_to_pd(cluster_factory):
    cluster = await cluster_factory(http=True)
    vocab_size = len(cluster.app.state.proxy.preprocessor.tokenizer)
    client = openai_client(cluster)
    try:
        await client.chat.completions.create(
            model="tiny-llava",
            messages=CHAT["messages"],
            max_tokens=3,
            logit_bias={"0": 100, str(vocab_size - 1): -100, "42": 2.5},
        )
        await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, logit_bias={})
    finally:
        await client.close()
    sent = [g.sampling for g in cluster.pd.generates]
    assert dict(sent[0].logit_bias) == {0: 100.0, vocab_size - 1: -100.0, 42: 2.5}
    assert dict(sent[1].logit_bias) == {}


@pytest.mark.parametrize(("path", "body"), BODIES)
@pytest.mark.parametrize(
    "logit_bias",
    [
        {"vocab": 1.0},  # replaced by the vocabulary size: one past the last id
        {"4294967296": 1.0},
        {"-1": 1.0},
        {"07": 1.0},
        {" 7": 1.0},
        {SECRET: 1.0},
        {"5": 100.5},
        {"5": -101},
        {"5": "high"},
        {str(i): 1.0 for i in range(301)},
    ],
    ids=[
        "id_is_vocab_size",
        "above_uint32",
        "negative",
        "leading_zero",
        "space",
        "word",
        "above_100",
        "below_minus_100",
        "string_value",
        "too_many",
    ],
)
async def test_a_bad_logit_bias_is_refused_before_any_work(cluster_factory, path, body, logit_bias):
    cluster = await cluster_factory()
    if "vocab" in logit_bias:
        logit_bias = {str(len(cluster.app.state.proxy.preprocessor.tokenizer)): 1.0}
    reply = await cluster.client.post(path, json={**body, "logit_bias": logit_bias})
    assert_refused(reply, "invalid_request", "logit_bias")
    assert cluster.pd.generates == []


async def test_the_sdk_sees_a_logit_bias_outside_the_vocabulary_refused(cluster_factory):
    cluster = await cluster_factory(http=True)
    vocab_size = len(cluster.app.state.proxy.preprocessor.tokenizer)
    client = openai_client(cluster)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(
                model="tiny-llava", prompt="Once", max_tokens=3, logit_bias={str(vocab_size): 5}
            )
    finally:
        await client.close()
    body = caught.value.body
    assert (body["code"], body["param"]) == ("invalid_request", "logit_bias")
    assert body["message"] == f"logit_bias token ids must be in [0, {vocab_size})."
    assert cluster.pd.generates == []


# ----------------------------------------------------------------------------- detokenizer options

DETOKENIZER_OPTIONS = ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")


async def test_the_sdk_sends_the_detokenizer_options_and_they_travel_to_pd(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    flipped = {"skip_special_tokens": False, "spaces_between_special_tokens": False, "include_stop_str_in_output": True}
    try:
        await client.chat.completions.create(
            model="tiny-llava", messages=CHAT["messages"], max_tokens=3, extra_body=flipped
        )
        await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3)
        await client.completions.create(
            model="tiny-llava",
            prompt="Once",
            max_tokens=3,
            extra_body={"skip_special_tokens": True, "include_stop_str_in_output": False},
        )
    finally:
        await client.close()
    sent = [g.sampling for g in cluster.pd.generates]
    assert [tuple(getattr(s, name) for name in DETOKENIZER_OPTIONS) for s in sent] == [
        (False, False, True),
        (False, False, False),  # unset: PD's defaults, vLLM's (true, true, false)
        (False, False, False),
    ]
    assert [s.HasField("skip_special_tokens") for s in sent] == [True, False, False]


@pytest.mark.parametrize(("path", "body"), BODIES)
@pytest.mark.parametrize("field", DETOKENIZER_OPTIONS)
@pytest.mark.parametrize("value", ["yes", 1, None], ids=str)
async def test_a_detokenizer_option_that_is_no_boolean_is_refused(cluster_factory, path, body, field, value):
    cluster = await cluster_factory()
    reply = await cluster.client.post(path, json={**body, field: value})
    assert_refused(reply, "invalid_request", field)
    assert cluster.pd.generates == []

"""OpenAI surface details the SDK relies on: model retrieval, field combinations, content types, logprobs."""

from __future__ import annotations

import json

import openai
import pytest
from proxy_doubles import openai_client

SECRET = "zebra-secret-42"
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
COMPLETION = {"prompt": "Once", "max_tokens": 8}


def assert_openai_error(reply, status: int, code: str, param: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["param"] == param
    assert SECRET not in reply.text
    return error


async def test_the_sdk_retrieves_the_served_model_and_only_it(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        model = await client.models.retrieve("tiny-llava")
        assert (model.id, model.object, model.owned_by) == ("tiny-llava", "model", "epd")
        listed = (await client.models.list()).data[0]
        assert model.model_dump() == listed.model_dump()
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve(SECRET)
        assert caught.value.body["code"] == "model_not_found" and SECRET not in caught.value.message
    finally:
        await client.close()
    for path in (f"/v1/models/{SECRET}", f"/v1/models/org/{SECRET}", "/v1/models/tiny-llava/x"):
        assert_openai_error(await cluster.client.get(path), 404, "model_not_found", "model_id")


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_stream_options_without_streaming_is_refused(cluster_factory, path, body):
    cluster = await cluster_factory()
    for stream in ({}, {"stream": False}):
        request = {**body, **stream, "stream_options": {"include_usage": True}}
        assert_openai_error(await cluster.client.post(path, json=request), 400, "invalid_request", "stream_options")
    assert cluster.pd.generates == []
    reply = await cluster.client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert reply.status_code == 200


async def test_the_sdk_sees_stream_options_refused_without_streaming(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(
                model="tiny-llava", prompt="Once", max_tokens=3, stream_options={"include_usage": True}
            )
        assert caught.value.body["param"] == "stream_options"
    finally:
        await client.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data", None]
)
async def test_a_body_not_declared_json_is_refused(cluster_factory, path, content_type):
    cluster = await cluster_factory()
    body = {**(CHAT if "chat" in path else COMPLETION), "user": SECRET}
    headers = {} if content_type is None else {"content-type": content_type}
    reply = await cluster.client.post(path, content=json.dumps(body).encode(), headers=headers)
    assert_openai_error(reply, 415, "unsupported_media_type")
    assert cluster.pd.generates == []


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
async def test_json_with_parameters_is_accepted(cluster_factory, content_type):
    cluster = await cluster_factory()
    reply = await cluster.client.post(
        "/v1/completions", content=json.dumps(COMPLETION).encode(), headers={"content-type": content_type}
    )
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_stop_token_ids_outside_the_vocabulary_are_refused(cluster_factory, path, body):
    cluster = await cluster_factory()
    vocab_size = len(cluster.app.state.proxy.preprocessor.tokenizer)
    for ids in ([vocab_size], [1, vocab_size + 1000], [2**32 - 1]):
        reply = await cluster.client.post(path, json={**body, "stop_token_ids": ids})
        assert_openai_error(reply, 400, "invalid_request", "stop_token_ids")
    assert cluster.pd.generates == []
    reply = await cluster.client.post(path, json={**body, "stop_token_ids": [0, vocab_size - 1]})
    assert reply.status_code == 200, reply.text
    assert list(cluster.pd.generates[0].sampling.stop_token_ids) == [0, vocab_size - 1]


async def test_completion_logprobs_zero_gives_the_sampled_token_as_its_top(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        reply = await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, logprobs=0)
        logprobs = reply.choices[0].logprobs
        assert len(logprobs.tokens) == 3
        assert logprobs.top_logprobs == [{token: lp} for token, lp in zip(logprobs.tokens, logprobs.token_logprobs)]
        reply = await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, logprobs=2)
        assert all(len(top) == 2 for top in reply.choices[0].logprobs.top_logprobs)  # alternatives as before
    finally:
        await client.close()


async def test_streamed_completion_text_offsets_continue_across_chunks(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        whole = await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, logprobs=1)
        stream = await client.completions.create(
            model="tiny-llava", prompt="Once", max_tokens=3, logprobs=1, stream=True
        )
        tokens, offsets = [], []
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    tokens.extend(choice.logprobs.tokens)
                    offsets.extend(choice.logprobs.text_offset)
    finally:
        await client.close()
    assert len(tokens) == 3
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert offsets == whole.choices[0].logprobs.text_offset


async def test_completions_echo_puts_the_prompt_before_the_text_whole_and_streamed(cluster_factory):
    cluster = await cluster_factory(http=True)
    client = openai_client(cluster)
    try:
        plain = await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3)
        echoed = await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, echo=True, n=2)
        stream = await client.completions.create(
            model="tiny-llava", prompt="Once", max_tokens=3, echo=True, stream=True
        )
        streamed = "".join([choice.text async for chunk in stream for choice in chunk.choices])
        ids = await client.completions.create(model="tiny-llava", prompt=[5, 6, 7], max_tokens=2, echo=True)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="tiny-llava", prompt="Once", max_tokens=3, echo=True, logprobs=1)
    finally:
        await client.close()
    assert [c.text for c in echoed.choices] == ["Once" + plain.choices[0].text] * 2
    assert streamed == "Once" + plain.choices[0].text
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens  # echoed, not counted again
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens
    tokenizer = cluster.app.state.proxy.preprocessor.tokenizer
    assert ids.choices[0].text.startswith(tokenizer.decode([5, 6, 7]))
    assert refused.value.body["param"] == "echo"


async def test_chat_template_kwargs_reach_the_template_and_cannot_change_how_it_is_applied(cluster_factory):
    cluster = await cluster_factory(http=True)
    preprocessor = cluster.app.state.proxy.preprocessor
    rendered: list[dict] = []
    real_render = preprocessor.render

    def recording_render(messages, template_kwargs=None):
        rendered.append(dict(template_kwargs or {}))
        return real_render(messages, template_kwargs)

    preprocessor.render = recording_render
    client = openai_client(cluster)
    try:
        await client.chat.completions.create(
            model="tiny-llava", **CHAT, extra_body={"chat_template_kwargs": {"enable_thinking": False, "persona": "x"}}
        )
        refusals = []
        for kwargs in ({"tokenize": True}, {"chat_template": "{{ 7 * 7 }}"}, {"_private": 1}, {"a": "x" * 1025}):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model="tiny-llava", **CHAT, extra_body={"chat_template_kwargs": kwargs}
                )
            refusals.append(refused.value.body["param"])
    finally:
        await client.close()
    assert rendered == [{"enable_thinking": False, "persona": "x"}]  # the refused ones never reached the template
    assert refusals == ["chat_template_kwargs"] * 4
    assert cluster.pd.generates and len(cluster.pd.generates) == 1


async def test_hide_cache_details_leaves_what_the_caches_did_out_of_usage(cluster_factory):
    """First review, still open then: usage told any client whether someone else sent the same image."""
    shown = await cluster_factory(http=True)
    hidden = await cluster_factory(http=True, hide_cache_details=True)
    usages = []
    for cluster in (shown, hidden):
        whole = await cluster.client.post("/v1/chat/completions", json=CHAT)
        stream = await cluster.client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        )
        last = [line for line in stream.text.splitlines() if line.startswith("data: {")][-1]
        usages.append((whole.json()["usage"], json.loads(last[len("data: ") :])["usage"]))
    for usage in usages[0]:
        assert "cached_tokens" in usage["prompt_tokens_details"] and "timings_ms" in usage["epd"]
    for usage in usages[1]:
        assert "prompt_tokens_details" not in usage
        assert set(usage["epd"]) == {"image_tokens", "video_tokens", "num_images"}
        assert usage["prompt_tokens"] == usages[0][0]["prompt_tokens"]

"""Must-show 4: the official ``openai`` client, unmodified, for every supported feature.

Chat and text completions, streaming and not: include_usage,
max_tokens / max_completion_tokens, temperature + seed reproducibility,
top_p, stop, logprobs / top_logprobs, n, user, response_format text,
images; and the error classes the client raises for our error statuses.
Greedy outputs are checked against ``transformers`` ``generate()``.
"""

from __future__ import annotations

import math

import openai
import pytest
from cluster_support import InProcessCluster
from oracle_support import make_image, user_message

API_KEY = "sk-test-e2e"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cluster = InProcessCluster(str(tiny_model_dir), proxy={"api_key": API_KEY, "max_n": 4}).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def client(cluster):
    with openai.OpenAI(base_url=cluster.base_url, api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client
    assert cluster.leaks() == {}


@pytest.fixture(scope="module")
def model(cluster) -> str:
    with openai.OpenAI(base_url=cluster.base_url, api_key=API_KEY) as client:
        return client.models.list().data[0].id


IDS = {"extra_body": {"return_token_ids": True}}
MESSAGES = [{"role": "system", "content": "Be brief."}, user_message("Tell me about the sea.", [])]


def ids_of(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def stream_chat(client, **kwargs) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str], object, list]:
    """Text, token ids and finish reason per choice index, the usage, and the raw chunks."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    usage, chunks = None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            ids.setdefault(choice.index, []).extend((choice.model_extra or {}).get("token_ids") or [])
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, ids, finish, usage, chunks


def test_chat_greedy_with_usage_user_and_response_format(client, model, oracle):
    expected = oracle.generate(MESSAGES, [], MAX_TOKENS)
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        user="user-1234",
        response_format={"type": "text"},
        **IDS,
    )
    assert ids_of(reply.choices[0]) == expected
    assert reply.choices[0].message.content == oracle.decode(expected)
    assert reply.usage.completion_tokens == len(expected)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    assert {"image_tokens", "timings_ms"} <= set(reply.usage.model_extra["epd"])

    texts, ids, finish, usage, chunks = stream_chat(
        client,
        model=model,
        messages=MESSAGES,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        user="user-1234",
        response_format={"type": "text"},
        stream_options={"include_usage": True},
        **IDS,
    )
    assert ids[0] == expected and texts[0] == oracle.decode(expected)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and usage.completion_tokens == len(expected)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_with_images_stream_and_not(client, model, oracle):
    images = [make_image(41), make_image(42, (40, 24))]
    messages = [user_message("Compare.", images)]
    expected = oracle.generate(messages, images, MAX_TOKENS)
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **IDS)
    assert ids_of(reply.choices[0]) == expected
    assert reply.usage.model_extra["epd"]["num_images"] == 2 and reply.usage.model_extra["epd"]["image_tokens"] > 0
    _, ids, _, _, chunks = stream_chat(
        client, model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **IDS
    )
    assert ids[0] == expected
    # vLLM's placement: a chat response's prompt ids at its top level; streamed, in the first chunk only
    prompt_ids = oracle.prompt_ids(messages, images)
    assert reply.model_extra["prompt_token_ids"] == prompt_ids
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in (chunk.model_extra or {}) for chunk in chunks[1:])


def test_max_completion_tokens_limits_the_output(client, model):
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


def test_temperature_and_seed_are_reproducible(client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=1234, **IDS)
    first = ids_of(client.chat.completions.create(**kwargs).choices[0])
    second = ids_of(client.chat.completions.create(**kwargs).choices[0])
    _, streamed, _, _, _ = stream_chat(client, **kwargs)
    assert first == second == streamed[0]
    others = {tuple(ids_of(client.chat.completions.create(**{**kwargs, "seed": s}).choices[0])) for s in range(5)}
    assert len(others | {tuple(first)}) > 1  # the seed matters


def test_a_tiny_top_p_is_greedy(client, model, oracle):
    expected = oracle.generate(MESSAGES, [], MAX_TOKENS)
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1e-6, seed=7, **IDS
    )
    assert ids_of(reply.choices[0]) == expected


def test_stop_string_cuts_the_output(client, model, oracle):
    full = oracle.decode(oracle.generate(MESSAGES, [], MAX_TOKENS))
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    want = full[: full.find(stop)]
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stop=[stop, "unlikely-stop-string"]
    )
    assert reply.choices[0].message.content == want and reply.choices[0].finish_reason == "stop"
    texts, _, finish, _, _ = stream_chat(
        client, model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stop=stop
    )
    assert texts[0] == want and finish[0] == "stop"


def test_chat_logprobs_and_top_logprobs(client, model, oracle):
    expected = oracle.generate(MESSAGES, [], MAX_TOKENS)
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == len(expected)
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert math.isclose(entry.logprob, max(t.logprob for t in entry.top_logprobs), abs_tol=1e-4)  # greedy
        assert entry.bytes == list(entry.token.encode())
    streamed = [
        entry
        for chunk in client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
        for choice in chunk.choices
        if choice.logprobs
        for entry in choice.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)


def test_n_choices_stream_and_not(client, model, oracle):
    expected = oracle.generate(MESSAGES, [], MAX_TOKENS)
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, n=3, **IDS
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(ids_of(c) == expected for c in reply.choices)  # greedy: every choice is the oracle's
    assert reply.usage.completion_tokens == 3 * len(expected)
    sampled = dict(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=99, n=2, **IDS)
    texts, ids, finish, usage, _ = stream_chat(client, stream_options={"include_usage": True}, **sampled)
    assert sorted(ids) == [0, 1] and sorted(finish) == [0, 1]
    again = client.chat.completions.create(**sampled)
    assert [ids_of(c) for c in again.choices] == [ids[0], ids[1]]  # reproducible per choice
    assert usage.completion_tokens == len(ids[0]) + len(ids[1])


def test_completions_endpoint_features(client, model, oracle):
    prompt = "Once upon a time"
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2, user="u", **IDS
    )
    choice = reply.choices[0]
    assert len(choice.model_extra["token_ids"]) == reply.usage.completion_tokens
    # vLLM's placement: a completion choice carries its prompt's ids (the tokenizer's, special tokens included)
    assert choice.model_extra["prompt_token_ids"] == oracle.processor.tokenizer(prompt)["input_ids"]
    assert len(choice.logprobs.tokens) == reply.usage.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text or choice.finish_reason == "stop"

    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            **IDS,
        )
    )
    by_index: dict[int, str] = {}
    prompt_ids: dict[int, list[list[int]]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
            if "prompt_token_ids" in c.model_extra:
                prompt_ids.setdefault(c.index, []).append(c.model_extra["prompt_token_ids"])
    assert by_index == {0: choice.text, 1: choice.text}
    wanted = [choice.model_extra["prompt_token_ids"]]
    assert prompt_ids == {0: wanted, 1: wanted}  # streamed: in each choice's first chunk only
    assert chunks[-1].usage.completion_tokens == 2 * reply.usage.completion_tokens

    token_prompt = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, stop=["\n"])
    assert token_prompt.usage.prompt_tokens == 4


def test_models_retrieve(client, model):
    served = client.models.retrieve(model)
    assert served.id == model and served.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found" and "no-such-model" not in missing.value.message


def test_completions_logprobs_zero_and_streamed_text_offsets(client, model):
    prompt = "Once upon a time"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    logprobs = whole.choices[0].logprobs
    assert logprobs.top_logprobs == [{t: lp} for t, lp in zip(logprobs.tokens, logprobs.token_logprobs)]
    offsets: list[int] = []
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0, stream=True
    ):
        for choice in chunk.choices:
            offsets.extend(choice.logprobs.text_offset if choice.logprobs else [])
    assert offsets == logprobs.text_offset and len(offsets) == MAX_TOKENS


def test_error_classes(client, model, cluster):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=MESSAGES, n=99)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with (
        openai.OpenAI(base_url=cluster.base_url, api_key="wrong", max_retries=0) as stranger,
        pytest.raises(openai.AuthenticationError),
    ):
        stranger.models.list()
    with pytest.raises(openai.APIStatusError) as timeout:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, extra_headers={"X-Request-Timeout": "0.000001"}
        )
    assert timeout.value.status_code == 504

    # The only PD drains: 503 with Retry-After, then service resumes by itself.
    cluster.run(cluster.pds[0].grpc.set_ready(False))
    try:
        with pytest.raises(openai.InternalServerError) as unavailable:
            for _ in range(100):  # until the proxy's health watch has seen it
                client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert unavailable.value.status_code == 503
        assert unavailable.value.response.headers["retry-after"] == "1"
    finally:
        cluster.run(cluster.pds[0].grpc.set_ready(True))
    for _ in range(100):
        try:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
            break
        except openai.InternalServerError:
            pass
    else:
        pytest.fail("the proxy did not resume after the PD was ready again")

"""Greedy output of the whole cluster equals transformers generate(), token for token.

The cluster (proxy -> encoder -> PD, or proxy -> colocated PD) runs on
loopback, once per model and mode; requests go through the official
``openai`` client, streaming and not. Models: LLaVA (CLIP and SigLIP towers),
Qwen2.5-VL and Qwen2-VL (dynamic resolution, multimodal RoPE), and a Qwen2.5-VL
copy whose generation_config lists an EOS id the model emits. With
``repetition_penalty`` the output equals ``generate(repetition_penalty=...)``.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from cluster_support import InProcessCluster, serving_preset
from oracle_support import Oracle, make_image, user_message

MAX_TOKENS = 24


# setup -> (preset, colocated)
SETUPS = {
    "llava": ("tiny", False),
    "llava-siglip": ("llava-siglip-tiny", False),
    "qwen2.5": ("qwen2.5-vl-tiny", False),
    "qwen2.5-colocated": ("qwen2.5-vl-tiny", True),
    "qwen2": ("qwen2-vl-tiny", False),
}


@pytest.fixture(scope="module")
def cluster(request, build_model):
    preset, colocated = SETUPS[request.param]
    yield from serving_preset(build_model, preset, colocated=colocated)


def _model(client) -> str:
    return client.models.list().data[0].id


def _chat(client, messages, stream: bool, max_tokens: int = MAX_TOKENS, **extensions):
    kwargs = dict(
        model=_model(client),
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, **extensions},
    )
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        return choice.model_extra["token_ids"], choice.message.content, choice.finish_reason, reply.usage
    token_ids, text, finish, usage = [], "", None, None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return token_ids, text, finish, usage


CASES = {
    "text_only": ("Tell me a story about a cat.", []),
    "one_image": ("What is in this picture?", [make_image(1)]),
    "three_images": ("Compare these pictures.", [make_image(2), make_image(3, (64, 30)), make_image(4, (20, 50))]),
    # Dynamic resolution: each keeps its aspect ratio and gets its own grid and token count.
    "wide_tall_square": (
        "Compare these pictures.",
        [make_image(5, (96, 32)), make_image(6, (32, 80)), make_image(7, (64, 64))],
    ),
}
RUNS = {
    "llava": ["text_only", "one_image", "three_images"],
    "llava-siglip": ["one_image", "three_images"],
    "qwen2.5": ["text_only", "one_image", "wide_tall_square"],
    "qwen2.5-colocated": ["text_only", "one_image", "wide_tall_square"],
    "qwen2": ["one_image", "wide_tall_square"],
}


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize(
    ("cluster", "case"), [(setup, case) for setup, cases in RUNS.items() for case in cases], indirect=["cluster"]
)
def test_greedy_tokens_equal_generate(client, oracle, case, stream):
    text, images = CASES[case]
    messages = [user_message(text, images)]
    expected = oracle.generate(messages, images, MAX_TOKENS)
    token_ids, content, finish, usage = _chat(client, messages, stream)
    assert token_ids == expected
    assert content == oracle.decode(expected)
    assert finish == ("length" if len(expected) == MAX_TOKENS else "stop")
    assert usage.completion_tokens == len(expected)
    assert usage.prompt_tokens > 0


@pytest.mark.parametrize(
    ("cluster", "count"), [("llava", 8), ("qwen2.5", 16), ("qwen2.5-colocated", 16)], indirect=["cluster"]
)
def test_concurrent_mixed_requests(client, oracle, count):
    requests = []
    for i in range(count):
        images = [make_image(100 + i * 10 + k, (32 + 8 * k, 32 + 16 * (i % 2))) for k in range(i % 3)]
        messages = [
            {"role": "system", "content": "You are terse."},
            user_message(f"Request number {i}: describe.", images),
        ]
        requests.append((messages, images, i % 2 == 1))
    expected = [oracle.generate(m, imgs, MAX_TOKENS) for m, imgs, _ in requests]
    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(lambda r: _chat(client, r[0], r[2]), requests))
    for want, (token_ids, content, _, _) in zip(expected, results):
        assert token_ids == want
        assert content == oracle.decode(want)


@pytest.mark.parametrize("cluster", ["llava", "qwen2.5"], indirect=True)
def test_repeated_image_is_served_again_identically(client, oracle):
    image = make_image(7)
    messages = [user_message("Once more.", [image])]
    expected = oracle.generate(messages, [image], MAX_TOKENS)
    first = _chat(client, messages, stream=False)[0]
    second = _chat(client, messages, stream=True)[0]
    assert first == second == expected


def _tower_layers(tower):
    """A CLIP or SigLIP tower's transformer layers (transformers nests them one level down in some versions)."""
    encoder = getattr(tower, "encoder", None) or tower.vision_model.encoder
    return encoder.layers


@pytest.mark.parametrize("cluster", ["llava", "qwen2.5"], indirect=True)
def test_each_service_holds_only_its_half_of_the_weights(cluster, oracle):
    from services.common.cpu_linear import KernelLinear
    from services.common.models import count_parameters

    full = oracle.model
    if hasattr(full.model, "visual"):  # Qwen: tower + merger
        vision_half = count_parameters(full.model.visual)
    else:
        vision_half = count_parameters(full.model.vision_tower) + count_parameters(full.model.multi_modal_projector)
    lm_half = count_parameters(full) - vision_half
    pd_model = cluster.pds[0].engine.core.runner.model
    encoder_module = cluster.encoders[0].vision.module

    def held(module) -> int:
        # The CPU linear kernel holds its weights packed (a buffer; the dense parameter dropped).
        packed_away = sum(
            m.in_features * m.out_features for m in module.modules() if isinstance(m, KernelLinear) and m.weight is None
        )
        return count_parameters(module) + packed_away

    assert held(pd_model) == lm_half
    if not hasattr(full.model, "visual"):  # LLaVA: the tower's layers past the feature layer are not loaded
        kept = len(_tower_layers(encoder_module.vision_tower))
        full_layers = _tower_layers(full.model.vision_tower)
        assert kept == len(full_layers) + full.config.vision_feature_layer + 1
        vision_half -= sum(count_parameters(layer) for layer in full_layers[kept:])
    assert held(encoder_module) == vision_half
    pd_names = [name for name, _ in pd_model.named_parameters()]
    encoder_names = [name for name, _ in encoder_module.named_parameters()]
    assert not any("vision" in n or "projector" in n or "visual" in n or "merger" in n for n in pd_names)
    assert not any("embed_tokens" in n or "lm_head" in n or "language_model" in n for n in encoder_names)
    # Everything that is held is materialised (nothing left on the meta device).
    assert all(p.device.type != "meta" for p in pd_model.parameters())
    assert all(p.device.type != "meta" for p in encoder_module.parameters())


@pytest.mark.parametrize("cluster", ["qwen2.5"], indirect=True)
def test_an_image_the_processor_refuses_is_a_400_and_serving_goes_on(client, oracle):
    thin = make_image(9, (1, 250))  # aspect ratio above Qwen's 200:1
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, [user_message("What is this?", [thin])], stream=False)
    assert refused.value.body["code"] == "invalid_image" and "aspect ratio" in refused.value.body["message"]
    messages = [user_message("And this?", [make_image(10)])]
    assert _chat(client, messages, stream=False)[0] == oracle.generate(messages, [make_image(10)], MAX_TOKENS)


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize(("cluster", "case"), [("llava", "text_only"), ("qwen2.5", "one_image")], indirect=["cluster"])
def test_min_tokens_equals_generate_min_new_tokens(client, oracle, case, stream):
    """A stop token the model picks early is held off for min_tokens outputs, as ``min_new_tokens`` does.

    The stop token is the plain run's second token, so without min_tokens the
    request stops at once; with it, the masked logits change the greedy path.
    """
    text, images = CASES[case]
    messages = [user_message(text, images)]
    stop_id = oracle.generate(messages, images, MAX_TOKENS)[1]
    stops = {"eos_token_id": [*oracle.eos_token_ids, stop_id]}
    early = oracle.generate(messages, images, MAX_TOKENS, **stops)
    assert len(early) <= 2 and early[-1] == stop_id
    assert _chat(client, messages, stream, stop_token_ids=[stop_id])[0] == early
    for min_tokens in (6, MAX_TOKENS):
        expected = oracle.generate(messages, images, MAX_TOKENS, min_new_tokens=min_tokens, **stops)
        assert stop_id not in expected[:min_tokens] and len(expected) > min_tokens - 1
        token_ids, content, finish, usage = _chat(
            client, messages, stream, stop_token_ids=[stop_id], min_tokens=min_tokens
        )
        assert token_ids == expected
        assert content == oracle.decode([t for t in expected if t != stop_id])
        assert finish == ("stop" if expected[-1] in stops["eos_token_id"] else "length")
        assert usage.completion_tokens == len(expected)


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize(
    ("cluster", "case"),
    [("llava", "text_only"), ("llava", "one_image"), ("qwen2.5", "text_only")],
    indirect=["cluster"],
)
def test_repetition_penalty_equals_generate(client, oracle, case, stream):
    """Greedy with ``repetition_penalty`` (over prompt and output, image placeholders included) is
    ``generate(repetition_penalty=...)``, token for token; both a penalty and a reward.

    The tiny models never repeat a token of their own, so the history holds
    their first answer: the second one then leans on the prompt's tokens,
    which a penalty pushes away.
    """
    text, images = CASES[case]
    first = oracle.decode(oracle.generate([user_message(text, images)], images, MAX_TOKENS))
    messages = [user_message(text, images), {"role": "assistant", "content": first}, user_message("Again.", [])]
    plain = oracle.generate(messages, images, MAX_TOKENS)
    for penalty in (3.0, 0.5):
        expected = oracle.generate(messages, images, MAX_TOKENS, repetition_penalty=penalty)
        assert expected != plain  # the penalty changes the greedy path
        token_ids, content, finish, usage = _chat(client, messages, stream, repetition_penalty=penalty)
        assert token_ids == expected
        assert content == oracle.decode(expected)
        assert usage.completion_tokens == len(expected)


def _openai_penalties(prompt_len: int, presence: float, frequency: float):
    """A ``generate()`` logits processor of OpenAI's formula over the output tokens (no transformers one exists)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class OpenAIPenalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            output = input_ids[:, prompt_len:]
            counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
            return scores - frequency * counts - presence * (counts > 0)

    return LogitsProcessorList([OpenAIPenalties()])


@pytest.mark.parametrize("cluster", ["qwen2.5"], indirect=True)
def test_presence_and_frequency_penalties_equal_generate_with_openais_formula(client, oracle):
    """The tiny models never repeat themselves unprompted: the largest reward (-2, -2) makes this one
    repeat its output's tokens (frequency counts above one); the largest penalty leaves it as it was."""
    text, images = CASES["text_only"]
    messages = [user_message(text, images)]
    plain = oracle.generate(messages, images, MAX_TOKENS)
    prompt_len = len(oracle.prompt_ids(messages, images))
    for presence, frequency in ((-2.0, -2.0), (2.0, 2.0)):
        processors = _openai_penalties(prompt_len, presence, frequency)
        expected = oracle.generate(messages, images, MAX_TOKENS, logits_processor=processors)
        assert (expected != plain) == (presence < 0)
        assert (len(set(expected)) < len(expected)) == (presence < 0)  # repeats: counts above one
        token_ids = _chat(client, messages, False, presence_penalty=presence, frequency_penalty=frequency)[0]
        assert token_ids == expected


@pytest.mark.parametrize("cluster", ["llava"], indirect=True)
def test_logit_bias_equals_generate_sequence_bias(client, oracle):
    """``logit_bias`` is ``generate(sequence_bias=...)`` with one-token sequences: banning the plain
    run's first token and favouring another change the greedy path the same way."""
    text, images = CASES["text_only"]
    messages = [user_message(text, images)]
    plain = oracle.generate(messages, images, MAX_TOKENS)
    logit_bias = {plain[0]: -100.0, plain[3]: 2.0}
    expected = oracle.generate(
        messages, images, MAX_TOKENS, sequence_bias={(token,): bias for token, bias in logit_bias.items()}
    )
    assert expected[0] != plain[0]
    token_ids, _, _, _ = _chat(client, messages, stream=False, logit_bias={str(t): b for t, b in logit_bias.items()})
    assert token_ids == expected


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("cluster", ["llava"], indirect=True)
def test_include_stop_str_in_output_keeps_the_stop_string_and_a_stop_token_adds_no_text(client, oracle, stream):
    text, images = CASES["text_only"]
    messages = [user_message(text, images)]
    plain = oracle.generate(messages, images, MAX_TOKENS)
    full = oracle.decode(plain)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    start = full.index(stop)
    for include, expected in ((False, full[:start]), (True, full[: start + len(stop)])):
        _, content, finish, _ = _chat(client, messages, stream, stop=[stop], include_stop_str_in_output=include)
        assert (content, finish) == (expected, "stop")
    # A stop token ends the text before its own text, unless asked (vLLM's rule); its id is reported either way.
    stop_id = plain[5]
    for include, decoded in ((False, plain[:5]), (True, plain[:6])):
        token_ids, content, finish, _ = _chat(
            client, messages, stream, stop_token_ids=[stop_id], include_stop_str_in_output=include
        )
        assert (token_ids, content, finish) == (plain[:6], oracle.decode(decoded), "stop")


EXTRA_EOS_CASE = "one_image"


@pytest.fixture(scope="module")
def extra_eos(build_model, oracle_for, tmp_path_factory):
    """(cluster, oracle, eos id) on a copy of the tiny Qwen2.5-VL whose generation_config lists a third
    EOS id: the token the model's greedy output for ``EXTRA_EOS_CASE`` takes second.

    The built-in models never emit their own EOS ids; this one they do, as a non-first id of the list.
    """
    source = build_model("qwen2.5-vl-tiny")
    text, images = CASES[EXTRA_EOS_CASE]
    eos_id = oracle_for("qwen2.5-vl-tiny").generate([user_message(text, images)], images, MAX_TOKENS)[1]
    model_dir = tmp_path_factory.mktemp("models") / "qwen2.5-vl-tiny-extra-eos"
    shutil.copytree(source, model_dir)
    config_path = model_dir / "generation_config.json"
    generation_config = json.loads(config_path.read_text())
    listed = generation_config["eos_token_id"]
    assert isinstance(listed, list) and len(listed) == 2 and eos_id not in listed
    generation_config["eos_token_id"] = [*listed, eos_id]
    config_path.write_text(json.dumps(generation_config))
    oracle = Oracle(str(model_dir))
    assert oracle.eos_token_ids == [*listed, eos_id]
    cluster = InProcessCluster(str(model_dir)).start()
    yield cluster, oracle, eos_id
    cluster.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_every_eos_id_of_the_checkpoint_stops_and_is_held_off_by_min_tokens(extra_eos, oracle_for, stream):
    """Any of the checkpoint's EOS ids ends a request, ``min_tokens`` masks them all, ``ignore_eos``
    ignores them all: as ``generate()`` does with its ``eos_token_id`` list."""
    cluster, oracle, eos_id = extra_eos
    text, images = CASES[EXTRA_EOS_CASE]
    messages = [user_message(text, images)]
    with openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        early = oracle.generate(messages, images, MAX_TOKENS)
        assert early[-1] == eos_id and len(early) == 2  # generate() stops on the third id
        token_ids, _, finish, usage = _chat(client, messages, stream)
        assert (token_ids, finish, usage.completion_tokens) == (early, "stop", 2)

        held_off = oracle.generate(messages, images, MAX_TOKENS, min_new_tokens=6)
        assert eos_id not in held_off[:6] and len(held_off) > 5
        token_ids, _, finish, _ = _chat(client, messages, stream, min_tokens=6)
        assert token_ids == held_off
        assert finish == ("stop" if held_off[-1] in oracle.eos_token_ids else "length")

        # With ignore_eos the run is the original checkpoint's, whose own EOS ids never come.
        unstopped = oracle_for("qwen2.5-vl-tiny").generate(messages, images, MAX_TOKENS)
        assert len(unstopped) == MAX_TOKENS and unstopped[1] == eos_id
        token_ids, _, finish, _ = _chat(client, messages, stream, ignore_eos=True)
        assert (token_ids, finish) == (unstopped, "length")
    assert cluster.leaks() == {}, "something was left reserved, pending or referenced"

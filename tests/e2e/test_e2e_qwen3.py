"""Qwen3-VL through the whole cluster: greedy output equals transformers generate(), token for token.

Dense and MoE, each disaggregated (proxy -> encoder -> PD), colocated (the PD
runs the vision tower) and E+P+D (the prefill PD gets the DeepStack features
and hands its KV to a decode PD): text, one image, three images of different
sizes, a video (a ``<t seconds>`` timestamp before each temporal patch), an
image and a video together; sixteen concurrent mixed requests; a burst of
sixteen requests for one new image, encoded once. Some setups run chunked
prefill with a small step budget, so chunks split images and videos and
steps pack several requests. One cluster per setup, shared by its tests; the
reference's outputs are computed once per model. A PD that drops the
DeepStack features (``--fault drop-deepstack``) answers what ``generate()``
answers without them, never what it answers with them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_support import chat, checked_client, serving_preset
from oracle_support import data_url, make_image
from video_support import make_video, reference_video_qwen3, video_part

from services.pd.faults import PdFaults

MAX_TOKENS = 12
CHUNKED = {"max_num_batched_tokens": 32}
SETUPS = {
    "dense": ("qwen3-vl-tiny", {"pd": CHUNKED}),
    "dense-colocated": ("qwen3-vl-tiny", {"colocated": True}),
    "dense-epd": ("qwen3-vl-tiny", {"num_decodes": 1}),
    "moe": ("qwen3-vl-moe-tiny", {}),
    "moe-colocated": ("qwen3-vl-moe-tiny", {"colocated": True, "pd": CHUNKED}),
    "moe-epd": ("qwen3-vl-moe-tiny", {"num_decodes": 1, "pd": CHUNKED}),
}
SHORT = make_video(1, num_frames=8, size=(48, 32), fps=4)  # 4 frames: two temporal patches
LONG = make_video(2, num_frames=24, size=(32, 48), fps=4, fmt="webm")  # 12 frames: six
_expected: dict[tuple[str, str], list[int]] = {}  # (preset, request name) -> generate()'s tokens
_new_images = itertools.count(300)  # seeds of images no cluster has seen


def _image(seed: int, size: tuple[int, int] = (48, 40)) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(make_image(seed, size))}, "_image": (seed, size)}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


CASES = {
    "text": [_text("Tell me a story about a cat.")],
    "one_image": [_image(1), _text("What is in this picture?")],
    "three_images": [_image(2, (96, 32)), _image(3, (32, 80)), _image(4, (64, 64)), _text("Compare them.")],
    "video": [video_part(SHORT), _text("What happens in this video?")],
    "image_and_video": [_image(5), video_part(LONG, "webm"), _text("Describe both.")],
}


def _mixed(i: int) -> list[dict]:
    """The i-th of sixteen concurrent requests: text, images of any size, videos, an image with a video."""
    kind = i % 4
    if kind == 0:
        return [_text(f"Request {i}: tell me something.")]
    if kind == 1:
        return [_image(100 + i, (32 + 8 * (i % 3), 40)), _text(f"Request {i}: describe.")]
    if kind == 2:
        return [video_part(SHORT if i % 8 == 2 else LONG, "mp4" if i % 8 == 2 else "webm"), _text(f"Request {i}.")]
    return [_image(100 + i, (64, 32)), video_part(SHORT), _text(f"Request {i}: both.")]


@pytest.fixture(scope="module")
def cluster(request, build_model):
    preset, options = SETUPS[request.param]
    yield from serving_preset(build_model, preset, **options)


def _wire(content: list[dict]) -> list[dict]:
    return [{k: v for k, v in part.items() if k != "_image"} for part in content]


def _reference_inputs(oracle, content: list[dict]) -> tuple[list, list]:
    """The images and the reference's videos of ``content``, in prompt order."""
    video_config = json.loads((oracle.model_dir / "video_preprocessor_config.json").read_text())
    images = [make_image(*part["_image"]) for part in content if "_image" in part]
    files = {video_part(SHORT)["video_url"]["url"]: SHORT, video_part(LONG, "webm")["video_url"]["url"]: LONG}
    image_processor = oracle.processor.image_processor
    videos = [
        reference_video_qwen3(files[part["video_url"]["url"]], image_processor, video_config)
        for part in content
        if part["type"] == "video_url"
    ]
    return images, videos


def _expect(oracle, preset: str, name: str, content: list[dict]) -> list[int]:
    """generate()'s greedy tokens for ``content``, computed once per model."""
    if (preset, name) not in _expected:
        images, videos = _reference_inputs(oracle, content)
        messages = [{"role": "user", "content": _wire(content)}]
        _expected[preset, name] = oracle.generate(messages, images, MAX_TOKENS, videos=videos or None)
    return _expected[preset, name]


def _chat(client, content: list[dict], stream: bool = False) -> tuple[list[int], object]:
    return chat(client, _wire(content), MAX_TOKENS, stream)


@pytest.mark.parametrize("cluster", list(SETUPS), indirect=True)
def test_each_kind_of_request_equals_generate(cluster, client, oracle):
    for index, (name, content) in enumerate(CASES.items()):
        expected = _expect(oracle, cluster.preset, name, content)
        token_ids, usage = _chat(client, content, stream=index % 2 == 1)
        assert token_ids == expected, name
        images, videos = _reference_inputs(oracle, content)
        messages = [{"role": "user", "content": _wire(content)}]
        prompt = oracle.inputs(messages, images, videos) if videos else oracle.inputs(messages, images)
        assert usage.prompt_tokens == prompt["input_ids"].shape[1], name  # timestamps and markers included


@pytest.mark.parametrize("cluster", list(SETUPS), indirect=True)
def test_sixteen_concurrent_mixed_requests(cluster, client, oracle):
    requests = [_mixed(i) for i in range(16)]
    expected = [_expect(oracle, cluster.preset, f"mixed-{i}", content) for i, content in enumerate(requests)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda item: _chat(client, item[1], stream=item[0] % 2 == 1), enumerate(requests)))
    assert [token_ids for token_ids, _ in results] == expected


def _num_encoded(cluster) -> int:
    if cluster.colocated:
        return cluster.pds[0].colocated.encoder.num_images_encoded
    return cluster.encoders[0].stats().num_images_encoded


@pytest.mark.parametrize("cluster", list(SETUPS), indirect=True)
def test_a_burst_of_sixteen_for_one_new_image_encodes_it_once(cluster, client, oracle):
    seed = next(_new_images)
    content = [_image(seed, (56, 40)), _text("All at once: what is this?")]
    expected = _expect(oracle, cluster.preset, f"burst-{seed}", content)
    start = _num_encoded(cluster)
    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(lambda _: _chat(client, content)[0], range(16)))
    assert outputs == [expected] * 16
    assert _num_encoded(cluster) == start + 1  # one vision forward: single flight, then the caches


@contextlib.contextmanager
def _without_deepstack(oracle) -> Iterator[None]:
    """``generate()`` with the LM's DeepStack step made a no-op (transformers' own model, patched)."""
    language_model = type(oracle.model.model.language_model)
    original = language_model._deepstack_process
    language_model._deepstack_process = lambda self, hidden_states, *_: hidden_states
    try:
        yield
    finally:
        language_model._deepstack_process = original


@pytest.fixture(scope="module")
def dropping(build_model):
    """A disaggregated qwen3-vl-tiny whose PD zeroes every embedding's DeepStack features."""
    yield from serving_preset(build_model, "qwen3-vl-tiny", pd={"faults": PdFaults(drop_deepstack=True)})


@pytest.fixture
def dropping_client(dropping):
    yield from checked_client(dropping)


def test_without_its_deepstack_features_the_cluster_answers_what_generate_answers_without_them(
    dropping_client, oracle_for
):
    oracle = oracle_for("qwen3-vl-tiny")
    for name in ("one_image", "three_images", "video", "image_and_video"):
        content = CASES[name]
        with_features = _expect(oracle, "qwen3-vl-tiny", name, content)
        images, videos = _reference_inputs(oracle, content)
        with _without_deepstack(oracle):
            messages = [{"role": "user", "content": _wire(content)}]
            without = oracle.generate(messages, images, MAX_TOKENS, videos=videos or None)
        token_ids, _ = _chat(dropping_client, content)
        assert token_ids == without != with_features, name
    text = CASES["text"]  # no image: nothing is dropped
    assert _chat(dropping_client, text)[0] == _expect(oracle, "qwen3-vl-tiny", "text", text)

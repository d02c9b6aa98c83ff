"""``epd bench serve`` workloads: seeded, reproducible requests, images and Poisson arrivals."""

from __future__ import annotations

import base64
import io
import itertools
import json
import statistics

import av
import pytest

from services.bench.serve.workload import (
    WORKLOADS,
    chat_body,
    encode_bodies,
    lone_requests,
    make_requests,
    poisson_arrivals,
    render_image,
    warmup_requests,
)


def requests(workload, count=400, seed=0, run=0):
    return make_requests(workload, count, seed=seed, run=run, image_size=32, prompt_words=8, max_tokens=16)


def test_poisson_arrivals_are_reproducible_and_scale_with_the_rate():
    slow = poisson_arrivals(500, 2.0, seed=7)
    assert slow == poisson_arrivals(500, 2.0, seed=7)
    assert slow != poisson_arrivals(500, 2.0, seed=8)
    fast = poisson_arrivals(500, 4.0, seed=7)
    assert fast == pytest.approx([t / 2 for t in slow])  # the same pattern, compressed
    assert slow[0] == 0.0 and slow == sorted(slow)
    gaps = [b - a for a, b in itertools.pairwise(slow)]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.15)  # exponential with mean 1/rate
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, seed=0)


def test_requests_are_reproducible_and_differ_between_runs():
    assert requests("mixed") == requests("mixed")
    assert requests("mixed", run=1) != requests("mixed", run=0)
    images_run0 = {ref.key for spec in requests("mixed", run=0) for ref in spec.images}
    images_run1 = {ref.key for spec in requests("mixed", run=1) for ref in spec.images}
    assert images_run0 and not images_run0 & images_run1  # no cache carries over between rates


def test_mixed_workload_is_mostly_text_with_one_to_four_images():
    specs = requests("mixed", count=1000)
    with_images = [s for s in specs if s.images]
    assert 0.07 < len(with_images) / len(specs) < 0.13
    assert {len(s.images) for s in with_images} == {1, 2, 3, 4}
    assert all(s.kind == "text" and s.image_class is None for s in specs if not s.images)
    assert all(s.image_class == "first_seen" for s in with_images)


def test_long_mixed_workload_has_long_text_prompts_images_and_short_text():
    specs = requests("long-mixed", count=1000)
    long = [s for s in specs if s.kind == "long"]
    with_images = [s for s in specs if s.kind == "image"]
    short = [s for s in specs if s.kind == "text"]
    assert 0.17 < len(long) / len(specs) < 0.23
    assert 0.07 < len(with_images) / len(specs) < 0.13
    assert len(short) == len(specs) - len(long) - len(with_images)
    # Long prompts: 420-840 words (~1-2k tokens on the bench checkpoint), text only; short ones keep
    # --prompt-words.
    assert all(420 <= len(s.prompt.split()) <= 840 and not s.images and s.image_class is None for s in long)
    assert all(len(s.prompt.split()) == 8 for s in short + with_images)
    assert {len(s.images) for s in with_images} == {1, 2}
    assert requests("long-mixed") == requests("long-mixed")
    # The other workloads draw no long prompts, and theirs stay what they were.
    assert not any(s.long_prompt for w in WORKLOADS if w != "long-mixed" for s in requests(w, count=50))


def test_long_mixed_calibrates_on_its_longest_prompt_and_warms_up_every_kind():
    texts, heavy = lone_requests("long-mixed", 2, seed=0, run=5, image_size=32)
    assert [t.kind for t in texts] == ["text", "text"]
    assert [(h.kind, len(h.prompt.split())) for h in heavy] == [("long", 840), ("long", 840)]
    warm = warmup_requests("long-mixed", seed=0, run=5, image_size=32, prompt_words=8)
    assert [w.kind for w in warm] == ["text", "long", "image"]
    assert [len(w.images) for w in warm] == [0, 0, 2]
    assert [w.kind for w in warmup_requests("mixed", seed=0, run=5, image_size=32)] == ["text", "image"]
    assert [w.kind for w in warmup_requests("text", seed=0, run=5, image_size=32)] == ["text"]


def test_multi_image_and_text_workloads():
    assert all(len(s.images) == 4 for s in requests("multi-image", count=50))
    assert not any(s.images for s in requests("text", count=50))


def test_repeat_workload_repeats_about_half_of_the_images():
    specs = requests("repeat", count=400)
    assert all(len(s.images) == 1 for s in specs)
    repeated = [s for s in specs if s.image_class == "repeated"]
    assert 0.4 < len(repeated) / len(specs) < 0.6
    seen = set()
    for spec in specs:  # "repeated" means: sent by an earlier request of the run
        key = spec.images[0].key
        assert (key in seen) == (spec.image_class == "repeated")
        seen.add(key)


def test_images_are_deterministic_noise_near_the_model_size():
    specs = requests("multi-image", count=5)
    ref = specs[0].images[0]
    assert 24 <= ref.width <= 40 and 24 <= ref.height <= 40  # 32 px +- 25%
    assert render_image(ref) == render_image(ref)
    assert render_image(ref) != render_image(specs[0].images[1])


def test_bodies_stream_a_fixed_number_of_tokens_with_token_ids():
    specs = requests("mixed", count=40)
    bodies = [json.loads(b) for b in encode_bodies(specs)]
    for spec, body in zip(specs, bodies):
        assert body["stream"] and body["ignore_eos"] and body["return_token_ids"]
        assert body["max_tokens"] == 16 and body["stream_options"] == {"include_usage": True}
        content = body["messages"][0]["content"]
        if spec.images:
            urls = [part["image_url"]["url"] for part in content if part["type"] == "image_url"]
            assert len(urls) == len(spec.images) and all(u.startswith("data:image/jpeg;base64,") for u in urls)
        else:
            assert content == spec.prompt
    assert chat_body(specs[0], {})["temperature"] == 0.0


def test_lone_requests_carry_the_workloads_most_images():
    texts, heavy = lone_requests("mixed", 2, seed=0, run=5, image_size=32)
    assert len(texts) == 2 and not any(t.images for t in texts)
    assert [len(h.images) for h in heavy] == [4, 4]
    assert len({ref.key for h in heavy for ref in h.images}) == 8  # all new
    assert lone_requests("text", 2, seed=0, run=5, image_size=32)[1] == []
    assert set(WORKLOADS) == {"mixed", "long-mixed", "multi-image", "repeat", "text", "video"}


def test_the_video_workload_sends_short_clips_half_of_them_repeated():
    specs = requests("video", count=40)
    with_video = [spec for spec in specs if spec.images]
    assert 10 < len(with_video) < 30 and all(len(spec.images) == 1 and spec.images[0].video for spec in with_video)
    assert {spec.image_class for spec in with_video} == {"first_seen", "repeated"}
    body = json.loads(encode_bodies(with_video[:1])[0])
    part = body["messages"][0]["content"][1]
    assert part["type"] == "video_url" and body["mm_processor_kwargs"]["fps"] in (1, 2)
    data = base64.b64decode(part["video_url"]["url"].split(",", 1)[1])
    with av.open(io.BytesIO(data)) as container:
        frames = sum(1 for _ in container.decode(video=0))
    assert frames == with_video[0].images[0].clip[0] and 8 <= frames <= 16


def test_images_go_before_the_text_only_when_asked():
    spec = next(s for s in requests("multi-image", count=3) if s.images)
    urls = {ref.key: f"data:image/jpeg;base64,{i}" for i, ref in enumerate(spec.images)}
    default = chat_body(spec, urls)["messages"][0]["content"]
    first = chat_body(spec, urls, images_first=True)["messages"][0]["content"]
    assert [part["type"] for part in default] == ["text"] + ["image_url"] * len(spec.images)
    assert [part["type"] for part in first] == ["image_url"] * len(spec.images) + ["text"]
    assert sorted(map(str, default)) == sorted(map(str, first))

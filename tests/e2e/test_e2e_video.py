"""Videos through the whole cluster: greedy output equals transformers generate(), token for token.

Qwen2.5-VL and Qwen2-VL, disaggregated (proxy -> encoder -> PD) and colocated
(the PD runs the vision tower), streaming and not: one video, a video and an
image, two videos of different lengths, a video given as its frames, a video
sampled by ``num_frames``; eight concurrent mixed requests; a repeated video
is served from the caches. The reference gets its video inputs from
``video_support`` (transformers' video processor needs torchvision, which is
not installed: its rules are written out there).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from cluster_support import InProcessCluster, chat, serving_preset
from oracle_support import data_url, make_image
from video_support import make_video, reference_frames, reference_video, video_part

MAX_TOKENS = 16

SETUPS = {
    "qwen2.5": ("qwen2.5-vl-tiny", False),
    "qwen2.5-colocated": ("qwen2.5-vl-tiny", True),
    "qwen2": ("qwen2-vl-tiny", False),
    "qwen2-colocated": ("qwen2-vl-tiny", True),
}
SHORT = make_video(1, num_frames=8, size=(48, 32), fps=4)  # 2 s at 4 fps: 4 frames at 2 fps, t = 2
LONG = make_video(2, num_frames=24, size=(32, 48), fps=4, fmt="webm")  # 6 s: 12 frames, t = 6


@pytest.fixture(scope="module")
def cluster(request, build_model):
    preset, colocated = SETUPS[request.param]
    yield from serving_preset(build_model, preset, colocated=colocated)


def _case(name: str, image_processor):
    """(content parts, reference videos, images, extensions) of one case."""
    text = {"type": "text", "text": "What happens in this video?"}
    frames = [make_image(10 + i, (40, 24)) for i in range(3)]
    cases = {
        "one_video": ([video_part(SHORT), text], [reference_video(SHORT, image_processor)], [], {}),
        "video_and_image": (
            [{"type": "image_url", "image_url": {"url": data_url(make_image(3))}}, video_part(SHORT), text],
            [reference_video(SHORT, image_processor)],
            [make_image(3)],
            {},
        ),
        "two_videos": (
            [video_part(SHORT), text, video_part(LONG, "webm")],
            [reference_video(SHORT, image_processor), reference_video(LONG, image_processor)],
            [],
            {},
        ),
        "frames": (
            [{"type": "video_url", "video_url": {"url": [data_url(f) for f in frames]}}, text],
            [reference_frames(frames, image_processor, fps=1.0)],
            [],
            {"mm_processor_kwargs": {"fps": 1}},
        ),
        "num_frames": (
            [video_part(LONG, "webm"), text],
            [reference_video(LONG, image_processor, num_frames=6)],
            [],
            {"mm_processor_kwargs": {"num_frames": 6}},
        ),
    }
    return cases[name]


RUNS = {
    "qwen2.5": ["one_video", "video_and_image", "two_videos", "frames", "num_frames"],
    "qwen2.5-colocated": ["one_video", "video_and_image", "two_videos"],
    "qwen2": ["one_video", "video_and_image", "two_videos"],
    "qwen2-colocated": ["one_video", "two_videos"],
}


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize(
    ("cluster", "case"), [(setup, case) for setup, cases in RUNS.items() for case in cases], indirect=["cluster"]
)
def test_video_greedy_tokens_equal_generate(client, oracle, case, stream):
    content, videos, images, extensions = _case(case, oracle.processor.image_processor)
    messages = [{"role": "user", "content": content}]
    expected = oracle.generate(messages, images, MAX_TOKENS, videos=videos)
    token_ids, usage = chat(client, content, MAX_TOKENS, stream, **extensions)
    assert token_ids == expected
    merge = oracle.processor.image_processor.merge_size
    video_tokens = sum(int(video.grid.prod()) // merge**2 for video in videos)
    assert usage.model_extra["epd"]["video_tokens"] == video_tokens
    assert usage.prompt_tokens == len(oracle.prompt_ids(messages, images)) - len(videos) + video_tokens


@pytest.mark.parametrize("cluster", ["qwen2.5", "qwen2.5-colocated"], indirect=True)
def test_a_repeated_video_is_served_from_the_cache(client, oracle):
    video = make_video(7, num_frames=6, size=(40, 40), fps=3)
    content = [video_part(video), {"type": "text", "text": "Again."}]
    expected = oracle.generate(
        [{"role": "user", "content": content}],
        [],
        MAX_TOKENS,
        videos=[reference_video(video, oracle.processor.image_processor)],
    )
    first_ids, first = chat(client, content, MAX_TOKENS, stream=False)
    again_ids, again = chat(client, content, MAX_TOKENS, stream=True)
    assert first_ids == again_ids == expected
    epd_first, epd_again = first.model_extra["epd"], again.model_extra["epd"]
    assert epd_first["num_images_ready"] == 0 and epd_first["num_encoder_cache_hits"] == 0
    # Served from PD's embedding cache (or the encoder's): no second vision forward.
    assert epd_again["num_images_ready"] + epd_again["num_encoder_cache_hits"] == 1
    assert again.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("cluster", ["qwen2.5", "qwen2.5-colocated"], indirect=True)
def test_eight_concurrent_mixed_text_image_video_requests(client, oracle):
    image_processor = oracle.processor.image_processor
    text = {"type": "text", "text": "Describe."}
    requests = [
        [text],
        [{"type": "image_url", "image_url": {"url": data_url(make_image(21))}}, text],
        [video_part(SHORT), text],
        [video_part(LONG, "webm"), text],
        [{"type": "text", "text": "Tell me a story."}],
        [video_part(SHORT), {"type": "image_url", "image_url": {"url": data_url(make_image(22))}}, text],
        [{"type": "image_url", "image_url": {"url": data_url(make_image(23))}}, text],
        [video_part(make_video(24, num_frames=10, fps=5)), text],
    ]
    references = {
        2: [reference_video(SHORT, image_processor)],
        3: [reference_video(LONG, image_processor)],
        5: [reference_video(SHORT, image_processor)],
        7: [reference_video(make_video(24, num_frames=10, fps=5), image_processor)],
    }
    images = {1: [make_image(21)], 5: [make_image(22)], 6: [make_image(23)]}
    expected = [
        oracle.generate([{"role": "user", "content": content}], images.get(i, []), MAX_TOKENS, videos=references.get(i))
        for i, content in enumerate(requests)
    ]
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda item: chat(client, item[1], MAX_TOKENS, stream=item[0] % 2 == 1), enumerate(requests))
        )
    assert [token_ids for token_ids, _ in results] == expected


def _video_requests(image_processor) -> list[tuple[list[dict], list, list]]:
    """Six requests: videos of both lengths, a video with an image, text; (content, references, images)."""
    text = {"type": "text", "text": "Describe the clip."}
    short, long = reference_video(SHORT, image_processor), reference_video(LONG, image_processor)
    picture = {"type": "image_url", "image_url": {"url": data_url(make_image(31))}}
    return [
        ([video_part(SHORT), text], [short], []),
        ([video_part(LONG, "webm"), text], [long], []),
        ([picture, video_part(LONG, "webm"), text], [long], [make_image(31)]),
        ([{"type": "text", "text": "A text request among videos."}], [], []),
        ([video_part(SHORT), text, video_part(LONG, "webm")], [short, long], []),
        ([video_part(LONG, "webm"), {"type": "text", "text": "Once more."}], [long], []),
    ]


@pytest.mark.parametrize(
    ("pd", "colocated"),
    [
        ({"max_num_batched_tokens": 16}, False),
        ({"max_num_batched_tokens": 16}, True),
        # Colocated, the vision forwards stagger the arrivals, so a small pool need not preempt: disaggregated only,
        # with no hold for images (a held PD admits the requests one by one as their videos land and the pool
        # fits them; without it the text before each video already holds KV when the videos land together).
        ({"num_kv_blocks": 0, "block_size": 16, "image_hold_s": 0.0}, False),
    ],
    ids=["chunked", "chunked-colocated", "preempted"],
)
def test_videos_through_chunked_prefill_and_preemption(build_model, oracle_for, pd, colocated):
    """A 16-token step budget splits every video span across steps; a KV pool barely larger than the longest
    request forces recompute preemption. Either way the output equals generate()."""
    oracle = oracle_for("qwen2.5-vl-tiny")
    requests = _video_requests(oracle.processor.image_processor)
    expected = [
        oracle.generate([{"role": "user", "content": content}], images, MAX_TOKENS, videos=refs or None)
        for content, refs, images in requests
    ]
    encoder = None
    if "num_kv_blocks" in pd:
        longest = max(len(oracle.prompt_ids([{"role": "user", "content": c}], i)) for c, _, i in requests)
        pd = {**pd, "num_kv_blocks": -(-(longest + 48 + MAX_TOKENS) // 16) + 1}  # + the tokens of the videos
        # Every video in one batch of the encoder, so that their requests reach PD together and contend
        # for the pool: encoded one by one, each could finish before the next one's embedding arrived.
        encoder = {"max_wait_ms": 3000.0, "max_batch_images": 16}
    model = str(build_model("qwen2.5-vl-tiny"))
    cluster = InProcessCluster(model, pd=pd, encoder=encoder, colocated=colocated).start()
    try:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=300)
        with client, ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(lambda r: chat(client, r[0], MAX_TOKENS, stream=False)[0], requests))
        assert got == expected
        stats = cluster.run(cluster.pds[0].stats())
        if "num_kv_blocks" in pd:
            assert stats.num_preemptions > 0, "the pool was meant to force preemption"
        else:
            assert stats.num_steps >= 2 * len(requests)
        assert cluster.leaks() == {}
    finally:
        cluster.stop()

"""Bad videos against a real cluster: each a 4xx OpenAI error that echoes none of the input.

Truncated and corrupt files, a non-video media type, an image posing as a
video, one video over each limit, too few frames to sample, a frame size
over the cap, bad sampling options, and a video sent to a LLaVA model. After
each, the cluster still serves a good video and nothing is left reserved,
pending or referenced. The table runs against Qwen2.5-VL and Qwen3-VL (its
own frame sampling and timestamps): the refusals are the same.
"""

from __future__ import annotations

import base64

import httpx
import pytest
from cluster_support import InProcessCluster
from oracle_support import data_url, make_image
from video_support import make_video, video_data_url, video_part

SECRET = "zq-video-secret-4411"
MAX_ERROR_BYTES = 1024
CLIP = make_video(5, num_frames=8, size=(48, 32), fps=4)
LIMITS = {"max_video_frames": 8, "max_video_seconds": 10.0, "max_video_bytes": 200_000, "max_image_pixels": 128 * 128}


def chat(*parts, **fields) -> dict:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def raw_video(data: bytes, media_type: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": f"data:{media_type};base64," + base64.b64encode(data).decode()}}


# (id, body, status, code)
CASES = [
    ("truncated", chat(raw_video(CLIP[:300]), SECRET), 400, "invalid_video_data"),
    ("corrupt", chat(raw_video(CLIP[:40] + SECRET.encode() * 40), SECRET), 400, "invalid_video_data"),
    ("not_a_container", chat(raw_video(SECRET.encode() * 10), SECRET), 400, "unsupported_video_format"),
    (
        "image_media_type",
        chat({"type": "video_url", "video_url": {"url": data_url(make_image(1))}}),
        400,
        "invalid_video_url",
    ),
    ("text_media_type", chat(raw_video(CLIP, "text/plain")), 400, "invalid_video_url"),
    (
        "png_as_mp4",
        chat(raw_video(base64.b64decode(data_url(make_image(2)).split(",")[1]))),
        400,
        "unsupported_video_format",
    ),
    (
        "bad_base64",
        chat({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,@@" + SECRET}}),
        400,
        "invalid_video_url",
    ),
    (
        "remote_url_disabled",
        chat({"type": "video_url", "video_url": {"url": "https://example.com/" + SECRET}}),
        400,
        "invalid_video_url",
    ),
    ("over_bytes", chat(raw_video(CLIP + bytes(200_000))), 400, "video_too_large"),
    ("over_seconds", chat(raw_video(make_video(6, num_frames=48, fps=4))), 400, "video_too_large"),
    ("over_frames", chat(video_part(CLIP), mm_processor_kwargs={"num_frames": 64}), 400, "video_too_large"),
    ("huge_frame_size", chat(raw_video(make_video(8, num_frames=4, size=(256, 160)))), 400, "video_too_large"),
    ("one_frame", chat(raw_video(make_video(9, num_frames=1))), 400, "invalid_video_data"),
    (
        "fps_and_num_frames",
        chat(video_part(CLIP), mm_processor_kwargs={"fps": 1, "num_frames": 4}),
        400,
        "invalid_request",
    ),
    ("unknown_option", chat(video_part(CLIP), mm_processor_kwargs={SECRET: 1}), 400, "invalid_request"),
    ("unknown_option_without_video", chat(SECRET, mm_processor_kwargs={SECRET: 1}), 400, "invalid_request"),
    ("fps_zero", chat(video_part(CLIP), mm_processor_kwargs={"fps": 0}), 400, "invalid_request"),
    (
        "frames_of_mixed_size",
        chat(
            {
                "type": "video_url",
                "video_url": {"url": [data_url(make_image(1, (32, 32))), data_url(make_image(2, (40, 32)))]},
            }
        ),
        400,
        "invalid_video_data",
    ),
    (
        "frame_not_an_image",
        chat({"type": "video_url", "video_url": {"url": [video_data_url(CLIP)]}}),
        400,
        "invalid_video_url",
    ),
]


@pytest.fixture(scope="module", params=["qwen2.5-vl-tiny", "qwen3-vl-tiny"])
def cluster(request, build_model):
    cluster = InProcessCluster(str(build_model(request.param)), proxy=LIMITS).start()
    yield cluster
    cluster.stop()


def _assert_clean_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert len(response.content) <= MAX_ERROR_BYTES
    assert SECRET not in response.text and "base64," not in response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("name", "body", "status", "code"), CASES, ids=[case[0] for case in CASES])
def test_bad_videos_are_refused_cleanly(cluster, name, body, status, code):
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        _assert_clean_error(http.post("/chat/completions", json=body), status, code)
        good = http.post("/chat/completions", json=chat(video_part(CLIP), "Still serving?"))
        assert good.status_code == 200, good.text
    assert cluster.leaks() == {}


def test_a_video_sent_to_a_llava_model_is_refused(tiny_model_dir):
    cluster = InProcessCluster(str(tiny_model_dir)).start()
    try:
        with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
            _assert_clean_error(
                http.post("/chat/completions", json=chat(video_part(CLIP), SECRET)), 400, "video_not_supported"
            )
            assert http.post("/chat/completions", json=chat("hello")).status_code == 200
        assert cluster.leaks() == {}
    finally:
        cluster.stop()

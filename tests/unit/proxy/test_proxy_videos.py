"""The proxy's video stage: sampling options, data URLs, counts, the frames form and its refusals."""

from __future__ import annotations

import base64

import pytest
from oracle_support import data_url, make_image
from video_support import make_video, video_data_url

from services.common import video_items
from services.common.encode_items import file_processor, item_pixels
from services.common.models import load_adapter
from services.common.video_files import CorruptVideoError, Sampling, VideoLimitError, VideoLimits
from services.proxy.errors import (
    InvalidVideoDataError,
    InvalidVideoUrlError,
    PlaceholderMismatchError,
    RequestError,
    VideoError,
    VideoNotSupportedError,
    VideoTooLargeError,
)
from services.proxy.prompt.preprocess import Preprocessor
from services.proxy.prompt.videos import check_videos, sampling_options, video_payload, video_refs

CLIP = make_video(3, num_frames=8, size=(48, 32), fps=4)


@pytest.fixture(scope="module")
def preprocessor(build_model) -> Preprocessor:
    adapter = load_adapter(str(build_model("qwen2.5-vl-tiny")))
    return Preprocessor(adapter, adapter.load_processor(), max_images=4, max_image_pixels=256 * 256)


def test_sampling_options_take_vllms_names_within_the_bounds():
    assert sampling_options(None, 64, 2) == Sampling(fps=2.0, max_frames=64)
    assert sampling_options({"fps": 1}, 64, 2) == Sampling(fps=1.0, max_frames=64)
    assert sampling_options({"num_frames": 8, "max_frames": 16}, 64, 2) == Sampling(num_frames=8, max_frames=16)


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"fps": 1, "num_frames": 4}, RequestError, "mm_processor_kwargs"),
        ({"size": 3}, RequestError, "mm_processor_kwargs"),
        ({"fps": 0}, RequestError, "mm_processor_kwargs.fps"),
        ({"fps": 61}, RequestError, "mm_processor_kwargs.fps"),
        ({"fps": True}, RequestError, "mm_processor_kwargs.fps"),
        ({"num_frames": 65}, VideoTooLargeError, "mm_processor_kwargs.num_frames"),
        ({"max_frames": 0}, VideoTooLargeError, "mm_processor_kwargs.max_frames"),
        ({"num_frames": 2.5}, VideoTooLargeError, "mm_processor_kwargs.num_frames"),
    ],
)
def test_bad_sampling_options_are_refused_naming_the_field(kwargs, error, param):
    with pytest.raises(error) as raised:
        sampling_options(kwargs, 64, 2)
    assert raised.value.param == param


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("data:video/mp4;base64", InvalidVideoUrlError),  # no comma
        ("data:video/mp4," + base64.b64encode(CLIP).decode(), InvalidVideoUrlError),  # not base64-flagged
        ("data:application/octet-stream;base64,AAAA", InvalidVideoUrlError),
        ("data:video/mp4;base64,", InvalidVideoDataError),  # empty
        ("https://example.com/clip.mp4", InvalidVideoUrlError),  # not a data URL (fetched bytes never get here)
    ],
)
def test_bad_video_data_urls_are_refused(url, error):
    with pytest.raises(error):
        video_payload(url)


def test_video_counts_and_models_without_videos_are_checked_before_any_work(preprocessor, tiny_model_dir):
    check_videos(preprocessor.adapter, 4, 4)
    with pytest.raises(VideoError, match="at most 4"):
        check_videos(preprocessor.adapter, 5, 4)
    with pytest.raises(VideoNotSupportedError):
        check_videos(load_adapter(str(tiny_model_dir)), 1, 4)
    check_videos(load_adapter(str(tiny_model_dir)), 0, 4)  # text and images only: nothing to refuse


def test_a_video_becomes_its_span_with_grid_timing_and_an_encoder_item(preprocessor):
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_data_url(CLIP)}}]}]
    refs = video_refs(messages)
    videos = preprocessor.chat_videos(refs, sampling_options(None, 64, 2))
    prompt = preprocessor.assemble(preprocessor.chat_tokens(messages), (), "", videos)
    (item,) = prompt.images
    video_id = preprocessor.adapter.video_token_id
    assert prompt.token_ids[item.offset : item.offset + item.num_tokens] == [video_id] * item.num_tokens
    assert item.patch_grid == (2, 4, 6) and item.token_grid == (2, 2, 3) and prompt.num_video_tokens == 12
    (wire,) = prompt.mm_items_pb()
    assert wire.second_per_grid_t == 1.0  # 4 frames kept at 2 fps, in pairs
    encode = item.encode_item_pb("reservation")
    assert encode.video_file == CLIP and encode.video_sampling.fps == 2.0
    adapter = preprocessor.adapter
    pixels, grid = item_pixels(
        encode, 0, adapter.pixel_layout(), file_processor(adapter, adapter.load_processor().image_processor)
    )
    assert grid == item.patch_grid and pixels.shape[0] == 2 * 4 * 6


def test_text_holding_the_video_token_is_refused(preprocessor):
    token = preprocessor.tokenizer.convert_ids_to_tokens(preprocessor.adapter.video_token_id)
    messages = [{"role": "user", "content": f"smuggled {token} here"}]
    with pytest.raises(PlaceholderMismatchError):
        preprocessor.assemble(preprocessor.chat_tokens(messages), (), "", ())
    with pytest.raises(PlaceholderMismatchError):
        preprocessor.completion_prompt(f"smuggled {token}")


def test_frames_keep_their_order_and_rate_and_odd_counts_are_padded(preprocessor):
    frames = [data_url(make_image(40 + i, (40, 24))) for i in range(3)]
    (video,) = preprocessor.chat_videos([frames], sampling_options({"fps": 1}, 64, 2))
    assert video.patch_grid[0] == 2 and video.second_per_grid_t == 2.0 and not video.video_file
    (reversed_order,) = preprocessor.chat_videos([frames[::-1]], sampling_options({"fps": 1}, 64, 2))
    assert reversed_order.mm_hash != video.mm_hash


def test_frames_of_an_extreme_aspect_ratio_are_refused(preprocessor):
    frames = [data_url(make_image(50, (402, 2)))] * 2
    with pytest.raises(VideoError, match="aspect ratio"):
        preprocessor.chat_videos([frames], sampling_options(None, 64, 2))


def test_the_frames_form_has_its_own_limits():
    limits = VideoLimits(max_frames=2)
    frame = base64.b64decode(data_url(make_image(1)).split(",", 1)[1])
    with pytest.raises(VideoLimitError, match="more than 2 frames"):
        video_items.sample_video(b"", (frame,) * 3, Sampling(), limits)
    with pytest.raises(CorruptVideoError, match="no frames"):
        video_items.sample_video(b"", (), Sampling(), limits)


def test_the_frames_forms_pixels_together_are_bounded_from_their_headers():
    frame = base64.b64decode(data_url(make_image(1, (32, 32))).split(",", 1)[1])
    with pytest.raises(VideoLimitError, match="3072 pixels; the limit is 2048"):
        video_items.sample_video(b"", (frame,) * 3, Sampling(), VideoLimits(max_total_pixels=2048))

"""Video files: sniffing, limits before decoding, sampling, corrupt input, hostile files (memory, time, seeking);
the vision side's video items."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from video_support import (
    decode_all,
    make_gop_video,
    make_video,
    mjpeg_that_grows,
    sample,
    vp8_keyframe_that_claims,
    vp8_static,
)

from services.common import encode_items, video_decode, video_files, video_items
from services.common.encode_items import file_processor, item_pixels
from services.common.models import load_adapter
from services.common.pb import epd_pb2
from services.common.video_decode import decode_frames
from services.common.video_files import (
    NO_BUDGET,
    CorruptVideoError,
    DecodeBudget,
    DecodeStopped,
    Sampling,
    UnsupportedVideoError,
    VideoLimitError,
    VideoLimits,
    probe,
    sample_indices,
)

CLIP = make_video(1, num_frames=12, size=(48, 32), fps=4)


def test_probe_reads_size_frames_and_rate_without_decoding():
    info = probe(CLIP, VideoLimits())
    assert (info.width, info.height, info.num_frames, info.fps) == (48, 32, 12, 4.0)
    webm = probe(make_video(2, num_frames=5, fps=5, fmt="webm"), VideoLimits())
    assert (webm.num_frames, webm.fps) == (5, 5.0)


@pytest.mark.parametrize(
    ("total", "video_fps", "fps"), [(12, 4.0, 2.0), (24, 4.0, 2.0), (30, 30.0, 1.0), (7, 3.0, 2.0), (100, 25.0, 2.0)]
)
def test_fps_sampling_follows_qwen2_vl_sample_frames(total, video_fps, fps):
    assert sample_indices(total, video_fps, Sampling(fps=fps)) == sample(total, video_fps, fps, 2)


def test_num_frames_sampling_is_spread_evenly_and_rounded_to_temporal_pairs():
    assert sample_indices(24, 4.0, Sampling(num_frames=6)) == [0, 4, 8, 12, 16, 20]
    assert sample_indices(24, 4.0, Sampling(num_frames=5)) == [i * 24 // 4 for i in range(4)]  # round(5/2)*2 = 4
    assert sample_indices(1, 4.0, Sampling()) == []  # one frame: nothing to pair


def test_decoded_frames_are_the_sampled_ones_with_their_rate():
    frames, info = decode_frames(CLIP, VideoLimits(), Sampling(fps=2.0))
    assert len(frames) == 6 and frames[0].size == (48, 32) and frames[0].mode == "RGB"
    assert video_files.sampled_fps(len(frames), info) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (VideoLimits(max_bytes=100), "larger than 100 bytes"),
        (VideoLimits(max_seconds=1.0), "longer than 1 seconds"),
        (VideoLimits(max_frame_pixels=48 * 31), "pixels; the limit"),
        (VideoLimits(max_seconds=0.01), "longer than|more than"),
    ],
)
def test_limits_are_checked_before_decoding(limits, message):
    with pytest.raises(VideoLimitError, match=message):
        probe(CLIP, limits)


def test_too_many_sampled_frames_are_refused_before_decoding():
    with pytest.raises(VideoLimitError, match="sampled to 6 frames; the limit is 4"):
        decode_frames(CLIP, VideoLimits(max_frames=4), Sampling(fps=2.0))


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 64, UnsupportedVideoError),  # an image is not a video
        (b"plain text, not a container", UnsupportedVideoError),
        (CLIP[:200], CorruptVideoError),  # truncated: header cut
        (CLIP[:24] + bytes(len(CLIP) - 24), CorruptVideoError),  # the rest zeroed
    ],
)
def test_bad_files_are_refused_with_their_kind(data, error):
    with pytest.raises(error):
        decode_frames(data, VideoLimits(), Sampling())


def test_a_single_frame_video_has_nothing_to_sample():
    with pytest.raises(CorruptVideoError, match="too few frames"):
        decode_frames(make_video(3, num_frames=1), VideoLimits(), Sampling())


def test_a_codec_outside_the_allow_list_is_refused(monkeypatch):
    monkeypatch.setattr(video_files, "ALLOWED_CODECS", ("h264",))
    with pytest.raises(UnsupportedVideoError, match="codec"):
        probe(CLIP, VideoLimits())


class _FewFrames(VideoLimits):
    max_total_frames = 5  # type: ignore[assignment]  # the bound as a constant, under the 12 of CLIP


def test_total_frames_are_bounded_while_counting():
    assert VideoLimits(max_seconds=10.0).max_total_frames == 600  # 60 frames a second at most, whatever it claims
    with pytest.raises(VideoLimitError, match="more than 5 frames"):
        probe(CLIP, _FewFrames())


@pytest.fixture(scope="module")
def qwen(build_model):
    adapter = load_adapter(str(build_model("qwen2.5-vl-tiny")))
    image_processor = adapter.load_processor().image_processor
    return adapter, image_processor, file_processor(adapter, image_processor)


def _video_item(adapter, image_processor, data: bytes, sampling: Sampling, salt: str = "") -> epd_pb2.EncodeItem:
    video = video_items.sample_video(data, (), sampling, encode_items.VIDEO_LIMITS)
    width, height = video.frames[0].size
    shape = adapter.video_shape(len(video.frames), height, width)
    digest = video_items.hash_video(
        video, adapter.processor_settings(), sampling, shape.patch_grid, adapter.model_id, salt, frames_given=False
    )
    t, h, w = shape.patch_grid
    return epd_pb2.EncodeItem(
        mm_hash=digest,
        reservation_id="r",
        grid=epd_pb2.ImageGrid(t=t, h=h, w=w),
        video_file=data,
        video_sampling=video_items.sampling_to_pb(sampling),
    )


def test_a_video_item_is_decoded_processed_and_its_hash_checked(qwen):
    adapter, image_processor, process_file = qwen
    sampling = Sampling(fps=2.0, max_frames=64)
    item = _video_item(adapter, image_processor, CLIP, sampling)
    pixels, grid = item_pixels(item, 0, adapter.pixel_layout(), process_file)
    assert grid == (3, 4, 6)  # 6 frames in pairs; 32x48 stays 32x48 (patch 8)
    assert tuple(pixels.shape) == (3 * 4 * 6, adapter.pixel_layout().patch_dim) and pixels.dtype == torch.float32
    forged = epd_pb2.EncodeItem()
    forged.CopyFrom(item)
    forged.mm_hash = "0" * 64
    with pytest.raises(ValueError, match="mm_hash is not the hash"):
        item_pixels(forged, 0, adapter.pixel_layout(), process_file)
    resampled = epd_pb2.EncodeItem()
    resampled.CopyFrom(item)
    resampled.video_sampling.fps = 1.0  # the hash names the sampling too
    with pytest.raises(ValueError, match="grid must be the patch grid|mm_hash is not the hash"):
        item_pixels(resampled, 0, adapter.pixel_layout(), process_file)


def test_video_patches_pair_consecutive_frames_channel_major(qwen):
    """The layout of transformers' video patchify: rows (t, h/m, w/m, m, m), columns (C, T, P, P)."""
    adapter, image_processor, _ = qwen
    frames, _ = decode_frames(CLIP, VideoLimits(), Sampling(fps=2.0))
    video = adapter.process_video(image_processor, frames)
    single = [adapter.process_image(image_processor, frame).pixel_values for frame in frames[:2]]
    patch = image_processor.patch_size
    rows = single[0].shape[0]
    one = [s.reshape(rows, 3, 2, patch, patch)[:, :, 0] for s in single]  # each image repeats its frame over T
    paired = np.stack(one, axis=2).reshape(rows, -1)
    np.testing.assert_array_equal(video.pixel_values[:rows], paired)
    assert video.patch_grid[0] == math.ceil(len(frames) / 2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda item: setattr(item.video_sampling, "fps", 0.0), "fps must be in"),
        (lambda item: setattr(item.video_sampling, "num_frames", 10_000), "more than 64 frames"),
        (lambda item: setattr(item, "video_file", CLIP[:100]), "video: The video header is corrupt"),
        (lambda item: item.frame_files.append(b"x"), "exactly one of"),
    ],
)
def test_bad_video_items_are_refused_naming_the_rule(qwen, change, message):
    adapter, image_processor, process_file = qwen
    item = _video_item(adapter, image_processor, CLIP, Sampling(fps=2.0, max_frames=64))
    change(item)
    with pytest.raises(ValueError, match=message):
        item_pixels(item, 0, adapter.pixel_layout(), process_file)


def test_a_model_without_videos_refuses_a_video_item(tiny_model_dir):
    adapter = load_adapter(str(tiny_model_dir))
    process_file = file_processor(adapter, adapter.load_processor().image_processor)
    item = epd_pb2.EncodeItem(mm_hash="a" * 64, reservation_id="r", video_file=CLIP)
    item.video_sampling.fps = 2.0
    with pytest.raises(ValueError, match="takes no videos"):
        item_pixels(item, 0, adapter.pixel_layout(), process_file)


def _audio_only_webm() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="webm") as container:
        stream = container.add_stream("libopus", rate=48000)
        for index in range(5):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 960), dtype=np.float32), format="flt", layout="mono")
            frame.sample_rate, frame.pts = 48000, index * 960
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def test_a_file_without_a_video_stream_is_refused():
    with pytest.raises(CorruptVideoError, match="no video stream"):
        probe(_audio_only_webm(), VideoLimits())


def test_a_webm_cut_before_its_first_frame_has_no_frames():
    webm = make_video(1, num_frames=12, fmt="webm")
    with pytest.raises(CorruptVideoError, match="no frames"):
        probe(webm[: len(webm) // 2], VideoLimits())


def _with_frames_zeroed(data: bytes, start_fraction: float) -> bytes:
    """``data`` (an MP4 whose index follows its frames) with its frame bytes zeroed from ``start_fraction`` on."""
    mdat, moov = data.find(b"mdat"), data.find(b"moov")
    start = mdat + 4 + int((moov - mdat) * start_fraction)
    return data[:start] + bytes(moov - 8 - start) + data[moov - 8 :]


def test_zeroed_frame_data_is_refused_before_or_while_decoding():
    with pytest.raises(CorruptVideoError, match="no frame size"):  # the first frame carries the codec header
        probe(_with_frames_zeroed(CLIP, 0.0), VideoLimits())
    damaged = _with_frames_zeroed(CLIP, 0.5)
    assert probe(damaged, VideoLimits()).num_frames == 12  # the index is intact: packets count as frames
    with pytest.raises(CorruptVideoError, match="truncated or corrupt"):
        decode_frames(damaged, VideoLimits(), Sampling(num_frames=12))


def test_the_sampled_frames_pixels_together_are_bounded_before_decoding():
    limits = VideoLimits(max_total_pixels=48 * 32 * 5)  # CLIP samples 6 frames of 48x32 at 2 fps
    with pytest.raises(VideoLimitError, match="sampled frames have 9216 pixels; the limit is 7680"):
        decode_frames(CLIP, limits, Sampling(fps=2.0))
    assert len(decode_frames(CLIP, limits, Sampling(num_frames=4))[0]) == 4


def test_a_video_hash_is_salted_per_tenant_and_checked_under_the_calls_salt(qwen):
    adapter, image_processor, process_file = qwen
    sampling = Sampling(fps=2.0, max_frames=64)
    salt = "ab" * 32
    shared = _video_item(adapter, image_processor, CLIP, sampling)
    salted = _video_item(adapter, image_processor, CLIP, sampling, salt)
    assert salted.mm_hash != shared.mm_hash
    item_pixels(salted, 0, adapter.pixel_layout(), process_file, salt)
    with pytest.raises(ValueError, match="mm_hash is not the hash"):  # another tenant's entry
        item_pixels(salted, 0, adapter.pixel_layout(), process_file)


class _StreamDouble:
    """Test double of a PyAV video stream: the rates and frame size ``_count_frames`` reads."""

    def __init__(self, rate) -> None:
        self.average_rate = self.guessed_rate = rate
        self.codec_context = type("CodecContext", (), {"width": 48, "height": 32})()


class _PacketDouble:
    size = 100
    pts = None
    is_keyframe = is_discard = False


class _ContainerDouble:
    """Test double of a PyAV container whose demuxer fails after ``num_packets`` packets."""

    def __init__(self, num_packets: int) -> None:
        self.num_packets = num_packets

    def demux(self, stream):
        yield from [_PacketDouble()] * self.num_packets
        raise av.error.InvalidDataError(1094995529, "Invalid data found when processing input")


def test_a_stream_without_a_frame_rate_is_refused_before_counting():
    with pytest.raises(CorruptVideoError, match="no frame rate"):
        video_files._count_frames(_ContainerDouble(3), _StreamDouble(None), VideoLimits(), NO_BUDGET)


def test_a_demuxer_error_while_counting_is_a_corrupt_video_not_a_crash():
    # A real truncated WebM just ends early (fewer frames); a demuxer that fails mid-file must not escape.
    with pytest.raises(CorruptVideoError, match="truncated or corrupt"):
        video_files._count_frames(_ContainerDouble(3), _StreamDouble(4), VideoLimits(), NO_BUDGET)


# ----------------------------------------------------------------------------- hostile videos: memory and time


def test_an_mjpeg_video_is_refused_before_a_frame_is_decoded():
    """MJPEG in Matroska, a 32x32 header and 8192x8192 frames after the first: refused for its codec."""
    with pytest.raises(UnsupportedVideoError, match="codec"):
        decode_frames(mjpeg_that_grows(), VideoLimits(), Sampling(num_frames=2))


_PEAK_OF_A_DECODE = """
import json, resource, sys
from services.common import video_files
from services.common.video_decode import decode_frames
from services.common.video_files import Sampling, VideoLimits
video_files.ALLOWED_CODECS = (*video_files.ALLOWED_CODECS, "mjpeg")  # the frame checks alone must hold
data = sys.stdin.buffer.read()
decode_frames(data[:{normal_size}], VideoLimits(), Sampling(num_frames=2))  # warm: the decoders' own buffers
idle_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    decode_frames(data[{normal_size}:], VideoLimits(), Sampling(num_frames=2))
    outcome = "decoded"
except ValueError as error:
    outcome = type(error).__name__
print(json.dumps({{"idle_kib": idle_kib, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "outcome": outcome}}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "make_probe", [mjpeg_that_grows, vp8_keyframe_that_claims], ids=["mjpeg_32_then_8192", "vp8_key_claims_8192"]
)
def test_frames_larger_than_the_header_are_refused_before_they_take_memory(make_probe):
    """Each probe's frames claim 8192x8192 under a 32x32 header: before, decoding them took the process past
    1.5 GB (MJPEG) or allocated 100 MB a frame (VP8). The decoder is held to the header's size and every frame
    is checked before it is converted: the peak stays within 20% of idle plus what the request may hold."""
    normal, probe_data = make_video(4, num_frames=4, size=(32, 32), fmt="webm"), make_probe()
    code = _PEAK_OF_A_DECODE.format(normal_size=len(normal))
    done = subprocess.run(
        [sys.executable, "-c", code], input=normal + probe_data, capture_output=True, timeout=100, check=True
    )
    result = json.loads(done.stdout)
    assert result["outcome"] in ("VideoLimitError", "CorruptVideoError")
    allowed_kib = 3 * len(probe_data) // 1024 + 2 * 32 * 32 * 3 // 1024  # the file, its copies, two kept frames
    assert result["peak_kib"] <= 1.2 * (result["idle_kib"] + allowed_kib), result


class _Ticks:
    """A clock that moves one second per reading: a budget of N seconds allows about N checks."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("deadline", [50.0, 250.0], ids=["while_counting", "while_decoding"])
def test_decoding_stops_within_a_frame_once_the_budget_ends(deadline):
    """One check a packet counted (200, after one at the start), then one a frame decoded: a deadline of 250
    ticks ends the decode at its 49th frame, long before the last sampled one (#150)."""
    clip = vp8_static(200, size=(64, 48))
    clock = _Ticks()
    budget = DecodeBudget(deadline=deadline, clock=clock)
    with pytest.raises(DecodeStopped):
        decode_frames(clip, VideoLimits(), Sampling(num_frames=4), budget)
    assert clock.now == deadline  # stopped at the first check that found the deadline passed


def test_a_cancelled_budget_stops_a_decode_and_a_live_one_lets_it_finish():
    clip = vp8_static(40, size=(64, 48))
    budget = DecodeBudget(deadline=time.monotonic() + 60)
    assert len(decode_frames(clip, VideoLimits(), Sampling(num_frames=4), budget)[0]) == 4
    budget.cancel()
    assert budget.cancelled
    with pytest.raises(DecodeStopped):
        decode_frames(clip, VideoLimits(), Sampling(num_frames=4), budget)
    with pytest.raises(DecodeStopped):
        video_items.sample_video(b"", [b"frame"], Sampling(), VideoLimits(), budget)  # the frames form too


def test_sparse_samples_seek_to_keyframes_and_get_the_frames_a_full_decode_gets(monkeypatch):
    clip = make_gop_video(7, num_frames=240, gop=8)
    seeks: list[int] = []
    seek = video_decode._TimestampWalk._seek
    monkeypatch.setattr(video_decode._TimestampWalk, "_seek", lambda self, i: (seeks.append(i), seek(self, i))[1])
    frames, info = decode_frames(clip, VideoLimits(), Sampling(num_frames=6))
    every, _ = decode_all(clip)
    wanted = sample_indices(info.num_frames, info.fps, Sampling(num_frames=6))
    assert [np.asarray(frame).tolist() for frame in frames] == [every[i].tolist() for i in wanted]
    assert seeks and all(index % 8 == 0 for index in seeks)  # jumped to keyframes, skipping whole groups


def test_without_timestamps_frames_are_read_in_order(monkeypatch):
    clip = make_gop_video(8, num_frames=60, gop=8)
    monkeypatch.setattr(video_files, "_timeline", lambda frame_pts, keyframe_pts: None)
    frames, info = decode_frames(clip, VideoLimits(), Sampling(num_frames=4))
    every, _ = decode_all(clip)
    wanted = sample_indices(info.num_frames, info.fps, Sampling(num_frames=4))
    assert [np.asarray(frame).tolist() for frame in frames] == [every[i].tolist() for i in wanted]


def test_the_frame_cap_trusts_no_frame_rate_above_60():
    clip = vp8_static(61, size=(64, 48), fps=1000)  # 0.06 s by its own account
    with pytest.raises(VideoLimitError, match="more than 60 frames"):
        probe(clip, VideoLimits(max_seconds=1.0))


def test_ffmpeg_loads_with_the_first_video_not_when_a_service_starts():
    # A cluster that serves text and images never maps FFmpeg's libraries; a service image may leave PyAV out.
    code = (
        "import sys, services.proxy.main, services.encoder.main, services.pd.main, services.common.video_decode\n"
        "assert 'av' not in sys.modules, 'imported at start-up'\n"
        "from services.common.video_files import probe, VideoLimits\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=Path(__file__).resolve().parents[3])

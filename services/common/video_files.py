"""Strict reading of video files: the proxy's client videos and the encoder's ``EncodeItem.video_file``.

Read with PyAV (FFmpeg's demuxers and decoders, wheels for every platform,
no torch or torchvision). As for images, each check runs before the work it
protects: the byte count first; the container is sniffed from its magic
bytes against an allow-list (MP4/QuickTime, Matroska/WebM) and opened with
that demuxer only; width x height, codec and duration come from the header;
the frames are counted from the packets (no decoding), and their timestamps
kept for seeking. Decoding the sampled frames is ``video_decode``'s. Both
loops stop at their request's ``DecodeBudget``. Messages never include the input.
"""

from __future__ import annotations

import io
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import av  # imported where a video is opened: FFmpeg's libraries load with the first video

ALLOWED_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4")
"""Video codecs decoded; anything else in an allowed container is refused before decoding. Not MJPEG (nor any
other intra-only still-image codec): each of its frames is a picture of its own, with its own size, so the header
bounds nothing and a few hundred bytes a frame can ask for the largest picture the codec allows."""

MAX_TRUSTED_FPS = 60.0
"""The frame rate the frame cap allows for (``VideoLimits.max_total_frames``): a file may claim any rate."""

_CONTAINERS = {"mp4": "mp4", "matroska": "matroska"}  # sniffed kind -> FFmpeg demuxer


class VideoFileError(ValueError):
    """Bytes that are not a video this project decodes."""


class UnsupportedVideoError(VideoFileError):
    """Not an MP4/QuickTime or Matroska/WebM file, or a codec outside ``ALLOWED_CODECS``."""


class VideoLimitError(VideoFileError):
    """Over a limit (bytes, seconds, frames, frame size), known before decoding."""


class CorruptVideoError(VideoFileError):
    """The header or the data is truncated or corrupt, or it holds no frame."""


class DecodeStopped(Exception):
    """Decoding stopped before it finished: its request's deadline passed or its request went away.

    Not a ``VideoFileError``: the file may be fine (the proxy answers 504, the encoder DEADLINE_EXCEEDED).
    """


class DecodeBudget:
    """When a decode must stop: its request's deadline and a cancel flag. Thread-safe.

    ``deadline`` is in ``clock()`` seconds (``time.monotonic``; None = none). The demux and decode loops call
    ``check()`` before every packet and frame, so a decode whose request has its answer (a 504 at the deadline)
    or has gone away (``cancel()``, idempotent) ends within one frame instead of holding its thread to the end
    of the file.
    """

    def __init__(self, deadline: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline = deadline
        self._clock = clock
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self) -> None:
        """Raises ``DecodeStopped`` once cancelled or past the deadline."""
        if self._cancelled.is_set():
            raise DecodeStopped("the request went away")
        if self.deadline is not None and self._clock() >= self.deadline:
            raise DecodeStopped("the request's deadline passed")


NO_BUDGET = DecodeBudget()
"""No deadline, never cancelled (callers that bound the work otherwise: tests, tools)."""


@dataclass(frozen=True)
class VideoLimits:
    """Bounds on one video, checked before decoding (``--max-video-*`` flags: proxy and encoder share the defaults)."""

    max_bytes: int = 32 << 20
    max_seconds: float = 300.0
    max_frames: int = 64  # sampled frames
    max_frame_pixels: int = 4096 * 4096
    # width x height x sampled frames: what decoding holds at once (3 bytes a pixel)
    max_total_pixels: int = 2 * 4096 * 4096

    @property
    def max_total_frames(self) -> int:
        """Frames a video may hold before sampling (``MAX_TRUSTED_FPS`` over ``max_seconds``): bounds decoding."""
        return max(1, math.ceil(self.max_seconds * MAX_TRUSTED_FPS))


@dataclass(frozen=True)
class Sampling:
    """How frames are taken (``VideoSampling`` on the wire, vLLM's ``mm_processor_kwargs``).

    ``num_frames`` > 0: that many, spread evenly; else ``fps`` frames a second,
    at least ``min_frames``, at most ``max_frames``. ``rule`` is the model
    family's way to pick them (``sample_indices``): ``qwen2_vl`` rounds both
    down to a multiple of ``temporal_patch_size`` (Qwen2-VL's
    ``sample_frames``); ``qwen3_vl`` takes them as they are, spread over the
    first to the last frame (Qwen3-VL's), the processor then pads the last
    temporal patch.
    """

    fps: float = 2.0
    num_frames: int = 0
    max_frames: int = 768
    min_frames: int = 4
    temporal_patch_size: int = 2
    rule: str = "qwen2_vl"

    def settings(self) -> dict[str, float | int]:
        """What the hash covers of the sampling."""
        return {"fps": self.fps, "num_frames": self.num_frames, "max_frames": self.max_frames}


@dataclass(frozen=True)
class Timeline:
    """Timestamps of a video's frames from its packets (stream time base), for seeking to keyframes."""

    frame_pts: tuple[int, ...]  # every frame's, ascending: presentation order (frame i has frame_pts[i])
    keyframe_pts: tuple[int, ...]  # the keyframes', ascending (the first frame's among them)


@dataclass(frozen=True)
class VideoInfo:
    """What the header and the packets say, before any frame is decoded."""

    width: int
    height: int
    num_frames: int  # frames shown (video packets, less those an edit list discards)
    fps: float  # the stream's average frame rate
    timeline: Timeline | None = None  # None: timestamps missing or repeated (frames are then decoded in order)


def sniff(data: bytes) -> str:
    """The container kind of ``data`` from its magic bytes; ``UnsupportedVideoError`` otherwise."""
    if len(data) >= 12 and data[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide"):
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    raise UnsupportedVideoError("The video is not an MP4, QuickTime, Matroska or WebM file.")


SAMPLING_RULES = ("qwen2_vl", "qwen3_vl")
"""The values of ``Sampling.rule``."""


def sample_indices(num_frames: int, fps: float, sampling: Sampling) -> list[int]:
    """Indices of the frames kept of ``num_frames`` at ``fps`` (by ``sampling.rule``), in order; may be empty."""
    if sampling.rule == "qwen3_vl":
        return _spread_indices(num_frames, fps, sampling)
    step = sampling.temporal_patch_size
    if sampling.num_frames > 0:
        wanted = min(round(sampling.num_frames / step) * step, num_frames // step * step)
    else:
        cap = math.floor(min(sampling.max_frames, num_frames) / step) * step
        wanted_f = min(max(num_frames / fps * sampling.fps, sampling.min_frames), cap, num_frames)
        wanted = math.floor(wanted_f / step) * step
    # torch.arange(0, n, n / k).int() without its float steps: exact floors of i * n / k.
    return [i * num_frames // wanted for i in range(wanted)] if wanted > 0 else []


def _spread_indices(num_frames: int, fps: float, sampling: Sampling) -> list[int]:
    """Qwen3-VL's ``sample_frames``: ``num_frames``, or ``fps`` a second within ``[min_frames,
    max_frames]`` and at most all of them, at ``linspace(0, num_frames - 1, n).round()`` (ties to even,
    as numpy rounds; a ``num_frames`` above the count repeats frames)."""
    if sampling.num_frames > 0:
        wanted = sampling.num_frames
    else:
        wanted = min(max(int(num_frames / fps * sampling.fps), sampling.min_frames), sampling.max_frames, num_frames)
    if wanted <= 0 or num_frames <= 0:
        return []
    return [int(i) for i in np.linspace(0, num_frames - 1, wanted).round().astype(int)]


def sampled_fps(num_sampled: int, info: VideoInfo) -> float:
    """The frame rate of the kept frames (transformers' ``VideoMetadata.sampled_fps``)."""
    return num_sampled / info.num_frames * info.fps


def probe(data: bytes, limits: VideoLimits, budget: DecodeBudget = NO_BUDGET) -> VideoInfo:
    """Checks bytes, container, codec, frame size and duration from the header, then counts packets."""
    if len(data) > limits.max_bytes:
        raise VideoLimitError(f"The video is larger than {limits.max_bytes} bytes.")
    budget.check()
    with open_container(data) as container:
        stream = video_stream(container, limits)
        info = _count_frames(container, stream, limits, budget)
    return info


def check_sampled(info: VideoInfo, indices: list[int], limits: VideoLimits) -> None:
    """Refuses a sampling with no frame, or one over ``max_frames`` or ``max_total_pixels``, before decoding."""
    if not indices:
        raise CorruptVideoError("The video has too few frames to sample.")
    if len(indices) > limits.max_frames:
        raise VideoLimitError(f"The video would be sampled to {len(indices)} frames; the limit is {limits.max_frames}.")
    total = len(indices) * info.width * info.height
    if total > limits.max_total_pixels:
        raise VideoLimitError(
            f"The video's sampled frames have {total} pixels; the limit is {limits.max_total_pixels}."
        )


class open_container:
    """``with open_container(data) as container``: ``av.open`` of ``data`` with the sniffed demuxer only, errors
    as ``VideoFileError``."""

    def __init__(self, data: bytes) -> None:
        import av

        kind = sniff(data)
        try:
            self.container = av.open(io.BytesIO(data), mode="r", format=_CONTAINERS[kind])
        except (av.FFmpegError, ValueError, EOFError):
            raise CorruptVideoError("The video header is corrupt.") from None

    def __enter__(self) -> av.container.InputContainer:
        return self.container

    def __exit__(self, *exc: object) -> None:
        self.container.close()


def video_stream(container: av.container.InputContainer, limits: VideoLimits) -> av.VideoStream:
    """The first video stream, its codec and header frame size and duration checked against ``limits``."""
    if not container.streams.video:
        raise CorruptVideoError("The file has no video stream.")
    stream = container.streams.video[0]
    if stream.codec_context.name not in ALLOWED_CODECS:
        raise UnsupportedVideoError("The video's codec is not supported.")
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:
        raise CorruptVideoError("The video has no frame size.")
    if width * height > limits.max_frame_pixels:
        raise VideoLimitError(
            f"The video's frames have {width * height} pixels; the limit is {limits.max_frame_pixels}."
        )
    import av

    seconds = container.duration / av.time_base if container.duration else 0.0
    if seconds > limits.max_seconds:
        raise VideoLimitError(f"The video is longer than {limits.max_seconds:g} seconds.")
    return stream


def _count_frames(
    container: av.container.InputContainer, stream: av.VideoStream, limits: VideoLimits, budget: DecodeBudget
) -> VideoInfo:
    import av

    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if not fps > 0:
        raise CorruptVideoError("The video has no frame rate.")
    count = shown = 0
    frame_pts: list[int] | None = []  # None once a packet has no timestamp
    keyframe_pts: list[int] = []
    try:
        for packet in container.demux(stream):
            if not packet.size:  # the demuxer's final flush packet is empty
                continue
            budget.check()
            count += 1
            if count > limits.max_total_frames:
                raise VideoLimitError(f"The video has more than {limits.max_total_frames} frames.")
            if packet.is_discard:  # decoded for its references, never shown (an edit list trimmed it)
                continue
            shown += 1
            if packet.pts is None:
                frame_pts = None
            elif frame_pts is not None:
                frame_pts.append(packet.pts)
                if packet.is_keyframe:
                    keyframe_pts.append(packet.pts)
    except av.FFmpegError:
        raise CorruptVideoError("The video data is truncated or corrupt.") from None
    if shown == 0:
        raise CorruptVideoError("The video has no frames.")
    if shown / fps > limits.max_seconds:
        raise VideoLimitError(f"The video is longer than {limits.max_seconds:g} seconds.")
    return VideoInfo(
        stream.codec_context.width, stream.codec_context.height, shown, fps, _timeline(frame_pts, keyframe_pts)
    )


def _timeline(frame_pts: list[int] | None, keyframe_pts: list[int]) -> Timeline | None:
    """The frames' timestamps, when every frame has its own and the first frame is a keyframe."""
    if not frame_pts or len(set(frame_pts)) != len(frame_pts):
        return None
    ordered = tuple(sorted(frame_pts))
    keys = tuple(sorted(keyframe_pts))
    if not keys or keys[0] != ordered[0]:
        return None
    return Timeline(ordered, keys)

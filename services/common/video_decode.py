"""Decoding the sampled frames of a video file, bounded in memory and in time.

``video_files.probe`` has checked the header and counted the packets; here
the sampled frames are decoded, one at a time, keeping only the sampled
ones. What bounds the work:

- memory: the decoder is told the header's frame size (FFmpeg's
  ``max_pixels``, with room for the codec's alignment), so a frame that
  claims more is refused before it is allocated; every decoded frame must
  then have exactly the header's size, checked before it is converted to
  RGB. The header's size was checked against the limits, so one frame costs
  at most ``max_frame_pixels`` and the kept ones at most ``max_total_pixels``;
- time: the request's ``DecodeBudget`` is checked before every frame, so a
  decode ends within one frame once its request has its answer or is gone;
  and when the next sampled frame lies past a keyframe far enough ahead
  (``SEEK_MIN_FRAMES``), the decoder jumps to that keyframe instead of
  decoding every frame in between.

Frames are picked by their timestamps (the ``Timeline`` of the packets) and,
in a file without usable timestamps or whose decoded frames do not follow
them, by their order; either way frame ``i`` is the ``i``-th in presentation
order, as a decoder that reads every frame sees it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import TYPE_CHECKING

from PIL import Image

from services.common.video_files import (
    NO_BUDGET,
    CorruptVideoError,
    DecodeBudget,
    Sampling,
    Timeline,
    VideoFileError,
    VideoInfo,
    VideoLimitError,
    VideoLimits,
    check_sampled,
    open_container,
    probe,
    sample_indices,
    video_stream,
)

if TYPE_CHECKING:
    import av

SEEK_MIN_FRAMES = 16
"""Frames a jump to a keyframe must save before the decoder seeks rather than reads on."""
_ALIGNMENT_ROOM = 64  # pixels a decoder may pad each side of a frame to (macroblocks, superblocks)
_MIN_DECODER_PIXELS = 1 << 16  # FFmpeg's MPEG-4 decoder checks its scratch buffers against max_pixels too
_CORRUPT = "The video data is truncated or corrupt, or a frame is larger than the header says."


def decode_frames(
    data: bytes, limits: VideoLimits, sampling: Sampling, budget: DecodeBudget = NO_BUDGET
) -> tuple[list[Image.Image], VideoInfo]:
    """The sampled frames of a video as RGB images (``probe`` first), and its header facts.

    Raises ``VideoFileError`` (a ValueError) for a file it refuses and ``DecodeStopped`` when ``budget`` ends.
    """
    info = probe(data, limits, budget)
    indices = sample_indices(info.num_frames, info.fps, sampling)
    check_sampled(info, indices, limits)
    distinct = sorted(set(indices))  # a rule may take a frame twice (Qwen3-VL's, for more frames than the file has)
    try:
        frames = _decode(data, limits, info, distinct, budget, by_timestamp=info.timeline is not None)
    except _TimelineMismatch:  # the timestamps misled: read every frame in order instead
        frames = _decode(data, limits, info, distinct, budget, by_timestamp=False)
    if len(distinct) == len(indices):
        return frames, info
    by_index = dict(zip(distinct, frames, strict=True))
    return [by_index[index] for index in indices], info


class _TimelineMismatch(Exception):
    """The decoder's frames did not follow the packets' timestamps."""


def _decode(
    data: bytes, limits: VideoLimits, info: VideoInfo, indices: list[int], budget: DecodeBudget, *, by_timestamp: bool
) -> list[Image.Image]:
    import av  # here, not at import: FFmpeg's libraries load with the first video

    frames: list[Image.Image] = []
    try:
        with open_container(data) as container:
            stream = video_stream(container, limits)
            # FFmpeg refuses a frame over this before it allocates it (the exact size is checked below).
            room = max((info.width + _ALIGNMENT_ROOM) * (info.height + _ALIGNMENT_ROOM), _MIN_DECODER_PIXELS)
            stream.codec_context.options = {"max_pixels": str(room)}
            if by_timestamp and info.timeline is not None:
                picked = _TimestampWalk(container, stream, info.timeline).frames(indices)
            else:
                picked = _in_order(container, stream, indices)
            for frame, keep in picked:
                budget.check()
                _check_size(frame, info)
                if keep:
                    frames.append(frame.to_image())  # RGB24
    except (VideoFileError, _TimelineMismatch):
        _close(frames)
        raise
    except (av.FFmpegError, ValueError, MemoryError):
        _close(frames)
        raise CorruptVideoError(_CORRUPT) from None
    except BaseException:
        _close(frames)
        raise
    if len(frames) != len(indices):
        _close(frames)
        raise CorruptVideoError(_CORRUPT)
    return frames


def _in_order(
    container: av.container.InputContainer, stream: av.VideoStream, indices: list[int]
) -> Iterator[tuple[av.VideoFrame, bool]]:
    """Every frame up to the last sampled one, in order, each with whether it is kept."""
    wanted, last = set(indices), indices[-1]
    for index, frame in enumerate(container.decode(stream)):
        yield frame, index in wanted
        if index == last:
            return


class _TimestampWalk:
    """Decodes forward from the start or from a keyframe, yielding each frame decoded with whether it is kept."""

    def __init__(self, container: av.container.InputContainer, stream: av.VideoStream, timeline: Timeline) -> None:
        self.container = container
        self.stream = stream
        self.timeline = timeline
        self.decoded: Iterator[av.VideoFrame] = container.decode(stream)
        self.next_index = 0  # index (presentation order) of the frame the decoder produces next

    def frames(self, indices: list[int]) -> Iterator[tuple[av.VideoFrame, bool]]:
        """The frames up to each sampled one, jumping to a keyframe that saves ``SEEK_MIN_FRAMES`` frames."""
        frame_pts = self.timeline.frame_pts
        for index in indices:
            key_index = self._keyframe_index_at_or_before(frame_pts[index])
            if key_index - self.next_index >= SEEK_MIN_FRAMES:
                self._seek(key_index)
            yield from self._up_to(frame_pts[index])

    def _keyframe_index_at_or_before(self, pts: int) -> int:
        keys = self.timeline.keyframe_pts
        key = keys[bisect.bisect_right(keys, pts) - 1]  # keys[0] is the first frame's (``Timeline``)
        return bisect.bisect_left(self.timeline.frame_pts, key)

    def _seek(self, key_index: int) -> None:
        self.container.seek(self.timeline.frame_pts[key_index], stream=self.stream, backward=True, any_frame=False)
        self.decoded = self.container.decode(self.stream)  # the decoder was flushed: read on from there
        self.next_index = key_index

    def _up_to(self, target: int) -> Iterator[tuple[av.VideoFrame, bool]]:
        """Frames until the one at ``target`` (kept). A frame past it, or none: the timestamps misled."""
        for frame in self.decoded:
            if frame.pts is None or frame.pts > target:
                raise _TimelineMismatch()
            self.next_index = bisect.bisect_right(self.timeline.frame_pts, frame.pts)
            yield frame, frame.pts == target
            if frame.pts == target:
                return
        raise _TimelineMismatch()


def _check_size(frame: av.VideoFrame, info: VideoInfo) -> None:
    """Every decoded frame has the header's size (the limits were checked against it), before any conversion."""
    if (frame.width, frame.height) == (info.width, info.height):
        return
    if frame.width * frame.height > info.width * info.height:
        raise VideoLimitError("A frame of the video is larger than its header says.")
    raise CorruptVideoError("The video's frames change size.")


def _close(frames: list[Image.Image]) -> None:
    for frame in frames:
        frame.close()

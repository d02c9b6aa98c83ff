"""One video item, read the same way by the proxy and the vision side: frames, sampling, hash.

A video arrives as a file (``video_files``) or as its frames (image files,
``image_files``). The proxy samples and decodes it to check it, count its
tokens and hash its frames; the encoder (or a colocated PD) does the same
from the same bytes and sampling, processes the frames and refuses an
``mm_hash`` that is not the one it computes. Torch-free (the proxy uses it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from services.common import image_files, video_decode, video_files
from services.common.hashing import video_hash
from services.common.pb import epd_pb2
from services.common.video_files import NO_BUDGET, DecodeBudget, Sampling, VideoLimits


@dataclass(frozen=True)
class SampledVideo:
    """The kept frames of one video (RGB, one size), their rate, and where they were taken from."""

    frames: list[Image.Image]
    fps: float  # frames a second of the kept frames
    indices: tuple[int, ...] = ()  # each kept frame's index in the source (its frames form: 0, 1, ...)
    source_fps: float = 0.0  # the source's frame rate (its frames form: the sampling's fps)

    def second_per_grid_t(self, temporal_patch_size: int) -> float:
        """Seconds one temporal patch spans (transformers' ``second_per_grid_ts``)."""
        return temporal_patch_size / self.fps

    def close(self) -> None:
        for frame in self.frames:
            frame.close()


def sampling_to_pb(sampling: Sampling) -> epd_pb2.VideoSampling:
    return epd_pb2.VideoSampling(fps=sampling.fps, num_frames=sampling.num_frames, max_frames=sampling.max_frames)


def sampling_from_pb(
    message: epd_pb2.VideoSampling, temporal_patch_size: int, limits: VideoLimits, rule: str = "qwen2_vl"
) -> Sampling:
    """The wire's sampling, bounded by ``limits``, picked by the model's ``rule`` (``Sampling.rule``);
    ValueError (naming the field) when out of range."""
    if not 0 < message.fps <= 240:
        raise ValueError("video_sampling.fps must be in (0, 240]")
    if message.num_frames > limits.max_frames or message.max_frames > limits.max_frames:
        raise ValueError(f"video_sampling asks for more than {limits.max_frames} frames")
    return Sampling(
        fps=float(message.fps),
        num_frames=int(message.num_frames),
        max_frames=int(message.max_frames) or limits.max_frames,
        temporal_patch_size=temporal_patch_size,
        rule=rule,
    )


def sample_video(
    video_file: bytes,
    frame_files: Sequence[bytes],
    sampling: Sampling,
    limits: VideoLimits,
    budget: DecodeBudget = NO_BUDGET,
) -> SampledVideo:
    """The kept frames of a video file, or the given frames (at ``sampling.fps``); ``VideoFileError`` /
    ``ImageFileError`` (both ValueError) for input it refuses, ``DecodeStopped`` when ``budget`` ends.
    CPU work: call it off the event loop."""
    budget.check()
    if video_file:
        decoded, info = video_decode.decode_frames(video_file, limits, sampling, budget)
        indices = video_files.sample_indices(info.num_frames, info.fps, sampling)
        return SampledVideo(decoded, video_files.sampled_fps(len(decoded), info), tuple(indices), info.fps)
    if not frame_files:
        raise video_files.CorruptVideoError("The video has no frames.")
    if len(frame_files) > limits.max_frames:
        raise video_files.VideoLimitError(f"The video has more than {limits.max_frames} frames.")
    sizes = [image_files.image_size(data, limits.max_frame_pixels) for data in frame_files]  # headers only
    if len(set(sizes)) != 1:
        raise video_files.CorruptVideoError("The video's frames must all have the same size.")
    total = len(sizes) * sizes[0][0] * sizes[0][1]
    if total > limits.max_total_pixels:
        raise video_files.VideoLimitError(
            f"The video's frames have {total} pixels; the limit is {limits.max_total_pixels}."
        )
    frames: list[Image.Image] = []
    try:
        for data in frame_files:
            budget.check()
            frames.append(image_files.decode_image_bytes(data, limits.max_frame_pixels))
    except BaseException:
        SampledVideo(frames, 1.0).close()
        raise
    return SampledVideo(frames, sampling.fps, tuple(range(len(frames))), sampling.fps)


def video_settings(
    processor_settings: Mapping[str, Any], sampling: Sampling, grid: Sequence[int], frames_given: bool
) -> dict[str, Any]:
    """What a video's ``mm_hash`` covers besides its frames: processor, sampling, grid and form."""
    return {
        **processor_settings,
        "video": {**sampling.settings(), "frames_given": frames_given},
        "grid": list(grid),
    }


def hash_video(
    video: SampledVideo,
    processor_settings: Mapping[str, Any],
    sampling: Sampling,
    grid: Sequence[int],
    model_id: str,
    cache_salt: str,
    *,
    frames_given: bool,
) -> str:
    """The video's ``mm_hash`` (``hashing.video_hash`` over its kept frames)."""
    settings = video_settings(processor_settings, sampling, grid, frames_given)
    return video_hash(video.frames, settings, model_id, cache_salt)

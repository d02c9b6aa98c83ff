"""Client videos: content parts, data URLs, sampling options and the video stage of preprocessing.

A chat content part ``{"type": "video_url", "video_url": {"url": ...}}`` (vLLM's)
holds a ``data:video/...;base64,`` URL, an https URL (behind the same opt-in
fetcher as images) or a list of image URLs: the video's frames. Sampling
follows vLLM's ``mm_processor_kwargs`` (``fps``, ``num_frames``,
``max_frames``), bounded by ``--max-video-frames``. The stage runs on the
image pool (off the event loop, on the proxy's video pool): limits from the header first
(``video_files.probe``), then the sampled frames are decoded
(``video_decode``), counted and hashed, the whole within the request's
``DecodeBudget``; the encoder gets the file and decodes it again (see the
docs, Models, for why decoding is not done here once).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from services.common import image_files, video_files, video_items
from services.common.grids import grid_to_pb
from services.common.models.processing import TooFewFramesError, UnsupportedImageError
from services.common.pb import epd_pb2
from services.common.video_files import NO_BUDGET, DecodeBudget, Sampling, VideoLimits
from services.proxy.errors import (
    ImageError,
    InvalidVideoDataError,
    InvalidVideoUrlError,
    RequestError,
    UnsupportedVideoFormatError,
    VideoError,
    VideoNotSupportedError,
    VideoTooLargeError,
)
from services.proxy.prompt.images import data_url_payload

VIDEO_MEDIA_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska")
SAMPLING_KEYS = ("fps", "num_frames", "max_frames")
DEFAULT_FPS = 2.0  # Qwen2-VL's (qwen-vl-utils' FPS)
MAX_FPS = 60.0

VideoRef = str | list[str]
"""One video of a message: a URL, or its frames' image URLs."""


@dataclass(frozen=True)
class ProcessedVideo:
    """One video after the video stage: what PD and the encoder need; its decoded frames are gone."""

    mm_hash: str
    num_tokens: int
    video_file: bytes  # the client's file (b"" for the frames form)
    frame_files: tuple[bytes, ...]  # the frames form's image files
    sampling: Sampling
    second_per_grid_t: float
    patch_grid: tuple[int, int, int]
    token_grid: tuple[int, int, int]
    # Text before and after each temporal patch's placeholders (Qwen3-VL's timestamps); () = one run.
    frame_texts: tuple[tuple[str, str], ...] = ()

    def encode_item_pb(self, reservation_id: str) -> epd_pb2.EncodeItem:
        """The encoder's item for this video: the file (or frames) and the sampling, to decode again."""
        return epd_pb2.EncodeItem(
            mm_hash=self.mm_hash,
            reservation_id=reservation_id,
            grid=grid_to_pb(self.patch_grid),
            video_file=self.video_file,
            frame_files=list(self.frame_files),
            video_sampling=video_items.sampling_to_pb(self.sampling),
        )


def video_refs(messages: Sequence[Mapping[str, Any]]) -> list[VideoRef]:
    """The videos of chat messages, in prompt order."""
    refs: list[VideoRef] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            refs.extend(part["video_url"]["url"] for part in content if part.get("type") == "video_url")
    return refs


def check_videos(adapter: Any, num_videos: int, max_videos: int) -> None:
    """Refuses videos for a model without them, and more than ``max_videos`` (before any is read)."""
    if num_videos and not getattr(adapter, "supports_video", False):
        raise VideoNotSupportedError("This model does not take videos.", "video_url")
    if num_videos > max_videos:
        raise VideoError(f"The request has {num_videos} videos; at most {max_videos} are allowed.", "messages")


def sampling_options(kwargs: Mapping[str, Any] | None, max_frames: int, temporal_patch_size: int) -> Sampling:
    """``mm_processor_kwargs`` as a ``Sampling``; 400 naming the field for anything else."""
    kwargs = kwargs or {}
    if any(key not in SAMPLING_KEYS for key in kwargs):
        raise RequestError("mm_processor_kwargs takes only fps, num_frames and max_frames.", "mm_processor_kwargs")
    fps, num_frames, cap = kwargs.get("fps"), kwargs.get("num_frames"), kwargs.get("max_frames")
    if fps is not None and num_frames is not None:
        raise RequestError("fps and num_frames are mutually exclusive.", "mm_processor_kwargs")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= MAX_FPS):
        raise RequestError(f"fps must be a number in (0, {MAX_FPS:g}].", "mm_processor_kwargs.fps")
    for name, value in (("num_frames", num_frames), ("max_frames", cap)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_frames
        ):
            raise VideoTooLargeError(f"{name} must be an integer in [1, {max_frames}].", f"mm_processor_kwargs.{name}")
    return Sampling(
        fps=float(fps if fps is not None else DEFAULT_FPS),
        num_frames=int(num_frames or 0),
        max_frames=int(cap or max_frames),
        temporal_patch_size=temporal_patch_size,
    )


def video_payload(url: str) -> bytes:
    """The bytes of a ``data:video/<type>;base64,`` URL (strict base64); ``VideoError`` otherwise."""
    header, sep, payload = url.removeprefix("data:").partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    if not url.startswith("data:") or not sep:
        raise InvalidVideoUrlError("Only data: URLs with base64 video payloads are supported here.", "video_url")
    if params[0] not in VIDEO_MEDIA_TYPES:
        raise InvalidVideoUrlError(
            "The data URL's media type must be video/mp4, video/webm, video/quicktime or video/x-matroska.",
            "video_url",
        )
    if "base64" not in params[1:]:
        raise InvalidVideoUrlError("The data URL must be base64-encoded (';base64,').", "video_url")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidVideoUrlError("The video payload is not valid base64.", "video_url") from None
    if not data:
        raise InvalidVideoDataError("The video payload is empty.", "video_url")
    return data


class VideoStage:
    """The video stage of a chat request (thread-safe: nothing shared is written)."""

    def __init__(self, adapter: Any, limits: VideoLimits) -> None:
        self.adapter = adapter
        self.limits = limits
        self._settings = adapter.processor_settings()

    def process(
        self,
        sources: Sequence[str | bytes | list[str | bytes]],
        sampling: Sampling,
        cache_salt: str,
        budget: DecodeBudget = NO_BUDGET,
    ) -> tuple[ProcessedVideo, ...]:
        """Every video's header limits first, then one video's frames alive at a time, picked by the model's
        rule (``Sampling.rule``); ``DecodeStopped`` once ``budget`` ends (checked before every packet and frame)."""
        sampling = dataclasses.replace(sampling, rule=self.adapter.video_sampling_rule)
        files = [self._files(source) for source in sources]
        for video_file, _ in files:
            if video_file:
                with _as_api_errors():
                    video_files.probe(video_file, self.limits, budget)
        return tuple(self._process(video_file, frames, sampling, cache_salt, budget) for video_file, frames in files)

    def _files(self, source: str | bytes | list[str | bytes]) -> tuple[bytes, tuple[bytes, ...]]:
        if isinstance(source, bytes):
            return source, ()
        if isinstance(source, str):
            return video_payload(source), ()
        frames = tuple(item if isinstance(item, bytes) else _frame_payload(item) for item in source)
        return b"", frames

    def _process(
        self,
        video_file: bytes,
        frame_files: tuple[bytes, ...],
        sampling: Sampling,
        cache_salt: str,
        budget: DecodeBudget,
    ) -> ProcessedVideo:
        with _as_api_errors():
            video = video_items.sample_video(video_file, frame_files, sampling, self.limits, budget)
        try:
            width, height = video.frames[0].size
            shape = self.adapter.video_shape(len(video.frames), height, width)
            digest = video_items.hash_video(
                video,
                self._settings,
                sampling,
                shape.patch_grid,
                self.adapter.model_id,
                cache_salt,
                frames_given=not video_file,
            )
            return ProcessedVideo(
                mm_hash=digest,
                num_tokens=shape.num_tokens,
                video_file=video_file,
                frame_files=frame_files,
                sampling=sampling,
                second_per_grid_t=video.second_per_grid_t(sampling.temporal_patch_size),
                patch_grid=shape.patch_grid,
                token_grid=shape.token_grid,
                frame_texts=self.adapter.video_frame_texts(video.indices, video.source_fps),
            )
        except TooFewFramesError as error:
            raise InvalidVideoDataError(str(error), "video_url") from None
        except UnsupportedImageError as error:
            raise VideoError(str(error), "video_url") from None
        finally:
            video.close()


def _frame_payload(url: str) -> bytes:
    try:
        return data_url_payload(url)
    except ImageError as error:
        raise InvalidVideoUrlError(f"A video frame: {error.message}", "video_url") from None


@contextmanager
def _as_api_errors() -> Iterator[None]:
    """``video_files`` / ``image_files`` errors (frames) as the 400s they are at the API."""
    try:
        yield
    except (video_files.UnsupportedVideoError, image_files.UnsupportedFormatError) as error:
        raise UnsupportedVideoFormatError(str(error), "video_url") from None
    except (video_files.VideoLimitError, image_files.TooManyPixelsError) as error:
        raise VideoTooLargeError(str(error), "video_url") from None
    except (video_files.VideoFileError, image_files.ImageFileError) as error:
        raise InvalidVideoDataError(str(error), "video_url") from None

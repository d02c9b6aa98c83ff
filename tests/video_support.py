"""Test videos made in memory with PyAV, and the reference's own reading of them.

transformers' Qwen2-VL video processor cannot be loaded here: it imports
torchvision, which is not installed (the services avoid it on purpose). So
the reference gets its video inputs from the rules written out below,
independently of the services' code: every frame decoded with PyAV, frames
picked as ``Qwen2VLVideoProcessor.sample_frames`` does (``torch.arange(0, n,
n / k).int()``), each resized with PIL's bicubic filter to ``smart_resize``'s
size, rescaled and normalised in numpy, padded and cut into patches as the
video processor's ``patchify`` does (torch view + permute), and
``second_per_grid_ts`` from the sampled fps as Qwen2.5-VL's processor computes it.

Qwen3-VL's video processor has rules of its own (``reference_video_qwen3``):
frames at ``np.linspace(0, n - 1, k).round()``, one size for the whole clip from
transformers' Qwen3-VL ``smart_resize`` (frames x height x width within the
video processor's bounds), and each temporal patch's timestamp, from
transformers' own ``Qwen3VLProcessor._calculate_timestamps``.
"""

from __future__ import annotations

import base64
import io
import math
import struct
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

MIME = {"mp4": "video/mp4", "webm": "video/webm"}
CODEC = {"mp4": "mpeg4", "webm": "libvpx"}


def make_video(
    seed: int, num_frames: int = 8, size: tuple[int, int] = (48, 32), fps: int = 4, fmt: str = "mp4"
) -> bytes:
    """A short clip of smooth, distinct frames (``size`` = width, height), encoded in memory."""
    rng = np.random.default_rng(seed)
    width, height = size
    base = rng.integers(0, 256, size=(height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=fmt) as container:
        stream = container.add_stream(CODEC[fmt], rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(num_frames):
            tile = np.roll(base, index, axis=1).repeat(8, axis=0).repeat(8, axis=1)[:height, :width]
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(tile), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def make_gop_video(seed: int, num_frames: int, gop: int, size: tuple[int, int] = (64, 48), fps: int = 10) -> bytes:
    """An MP4 (MPEG-4 part 2) of distinct frames with a keyframe every ``gop`` frames."""
    rng = np.random.default_rng(seed)
    width, height = size
    base = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        for index in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(np.roll(base, index, axis=1)), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


# ----------------------------------------------------------------------------- probes: hostile videos


def _mux_packets(fmt: str, codec: str, size: tuple[int, int], fps: int, payloads: list[bytes], keys: list[bool]):
    """A container whose one video stream's header says ``size``, holding ``payloads`` as its packets."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height = size
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        for index, (data, key) in enumerate(zip(payloads, keys)):
            packet = av.Packet(data)
            packet.stream, packet.time_base, packet.pts, packet.dts = stream, Fraction(1, fps), index, index
            packet.is_keyframe = key
            container.mux(packet)
    return buffer.getvalue()


def _jpeg(size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (90, 120, 30)).save(buffer, format="JPEG", quality=20)
    return buffer.getvalue()


def mjpeg_that_grows(num_big: int = 2, big: int = 8192, small: int = 32) -> bytes:
    """MJPEG in Matroska: a ``small``² header and first frame, then ``num_big`` frames of ``big``²."""
    payloads = [_jpeg((small, small))] + [_jpeg((big, big))] * num_big
    return _mux_packets("matroska", "mjpeg", (small, small), 4, payloads, [True] * len(payloads))


def _vp8_packets(num_frames: int, size: tuple[int, int], gop: int = 1_000_000, step: int = 40) -> list[bytes]:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="webm") as container:
        stream = container.add_stream("libvpx", rate=Fraction(30))
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.codec_context.gop_size = gop
        packets = []
        for index in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), step * index, np.uint8), format="rgb24")
            frame.pts = index
            packets += [bytes(p) for p in stream.encode(frame)]
        packets += [bytes(p) for p in stream.encode(None)]
    return packets


def vp8_keyframe_that_claims(big: int = 8192, num_big: int = 4, small: int = 32) -> bytes:
    """VP8 in WebM, header and first frame ``small``², then keyframes whose own headers claim ``big``²
    (the first keyframe with its size fields rewritten: a decoder sizes its buffers before it reads the rest)."""
    key = _vp8_packets(2, (small, small), gop=1)[0]
    assert key[3:6] == b"\x9d\x01\x2a"  # a VP8 keyframe's start code; width and height follow
    claiming = key[:6] + struct.pack("<HH", big, big) + key[10:]
    payloads = [key] + [claiming] * num_big
    return _mux_packets("webm", "libvpx", (small, small), 4, payloads, [True] * len(payloads))


def vp8_static(num_frames: int, size: tuple[int, int] = (640, 360), fps: int = 30) -> bytes:
    """VP8 in WebM: one keyframe, then ``num_frames - 1`` copies of one empty inter frame (a few bytes each
    that still cost a full frame to decode)."""
    first, *_, inter = _vp8_packets(3, size, step=0)  # frames alike: the last inter frame changes nothing
    payloads = [first] + [inter] * (num_frames - 1)
    return _mux_packets("webm", "libvpx", size, fps, payloads, [True] + [False] * (num_frames - 1))


def video_data_url(data: bytes, fmt: str = "mp4") -> str:
    return f"data:{MIME[fmt]};base64," + base64.b64encode(data).decode()


def video_part(data: bytes, fmt: str = "mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": video_data_url(data, fmt)}}


@dataclass
class ReferenceVideo:
    """A video as the reference model takes it."""

    pixel_values: torch.Tensor  # [t*h*w, C*T*P*P]
    grid: torch.Tensor  # [3]: (t, h, w) in patches
    second_per_grid_t: float
    timestamps: list[float] | None = None  # Qwen3-VL: seconds of each temporal patch (its prompt text)


def decode_all(data: bytes) -> tuple[list[np.ndarray], float]:
    """Every frame (RGB, HWC uint8) and the stream's average rate."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    return frames, fps


def sample(
    total: int, video_fps: float, fps: float, temporal: int, min_frames: int = 4, max_frames: int = 768
) -> list[int]:
    """``Qwen2VLVideoProcessor.sample_frames`` with ``fps``."""
    max_frames = math.floor(min(max_frames, total) / temporal) * temporal
    num = min(max(total / video_fps * fps, min_frames), max_frames, total)
    num = math.floor(num / temporal) * temporal
    return torch.arange(0, total, total / num).int().tolist()


def reference_video(data: bytes, image_processor, fps: float = 2.0, num_frames: int = 0) -> ReferenceVideo:
    """The reference's own reading of a video file (module docstring)."""
    frames, video_fps = decode_all(data)
    temporal = image_processor.temporal_patch_size
    if num_frames:
        num = round(num_frames / temporal) * temporal
        indices = torch.arange(0, len(frames), len(frames) / num).int().tolist()
    else:
        indices = sample(len(frames), video_fps, fps, temporal)
    picked = [frames[i] for i in indices]
    pixels, grid = patches(picked, image_processor)
    sampled_fps = len(indices) / len(frames) * video_fps
    return ReferenceVideo(pixels, grid, temporal / sampled_fps)


def reference_frames(images: list[Image.Image], image_processor, fps: float = 2.0) -> ReferenceVideo:
    """A video given as its frames (images), at ``fps``."""
    pixels, grid = patches([np.asarray(image.convert("RGB")) for image in images], image_processor)
    return ReferenceVideo(pixels, grid, image_processor.temporal_patch_size / fps)


def reference_video_qwen3(
    data: bytes, image_processor, video_config: dict, fps: float = 2.0, num_frames: int = 0
) -> ReferenceVideo:
    """Qwen3-VL's reading of a video file (module docstring); ``video_config`` is the checkpoint's
    ``video_preprocessor_config.json``."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as smart_resize_3d

    frames, video_fps = decode_all(data)
    total = len(frames)
    if not num_frames:
        num_frames = min(
            max(int(total / video_fps * fps), video_config["min_frames"]), video_config["max_frames"], total
        )
    indices = np.linspace(0, total - 1, num_frames).round().astype(int).tolist()
    picked = [frames[i] for i in indices]
    temporal = image_processor.temporal_patch_size
    size = smart_resize_3d(
        len(picked),
        *picked[0].shape[:2],
        temporal_factor=temporal,
        factor=image_processor.patch_size * image_processor.merge_size,
        min_pixels=video_config["size"]["shortest_edge"],
        max_pixels=video_config["size"]["longest_edge"],
    )
    pixels, grid = patches(picked, image_processor, size)
    timestamps = Qwen3VLProcessor._calculate_timestamps(None, indices, video_fps, temporal)
    return ReferenceVideo(pixels, grid, temporal / (len(indices) / total * video_fps), timestamps)


def patches(
    frames: list[np.ndarray], processor, size: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Resize (to ``size``, else by the image processor's bounds), rescale, normalise, pad and patchify
    (the video processor's ``_preprocess``)."""
    patch, merge, temporal = processor.patch_size, processor.merge_size, processor.temporal_patch_size
    height, width = frames[0].shape[:2]
    new_h, new_w = size or smart_resize(
        height,
        width,
        factor=patch * merge,
        min_pixels=processor.size["shortest_edge"],
        max_pixels=processor.size["longest_edge"],
    )
    mean = np.asarray(processor.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(processor.image_std, dtype=np.float32)[:, None, None]
    stacked = []
    for frame in frames:
        resized = np.asarray(Image.fromarray(frame).resize((new_w, new_h), Image.Resampling.BICUBIC))
        chw = resized.transpose(2, 0, 1).astype(np.float32) / 255.0
        stacked.append((chw - mean) / std)
    video = torch.from_numpy(np.stack(stacked))[None]  # [1, F, C, H, W]
    if pad := -video.shape[1] % temporal:
        video = torch.cat([video, video[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
    _, num, channel, h, w = video.shape
    gt, gh, gw = num // temporal, h // patch, w // patch
    x = video.view(1, gt, temporal, channel, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(gt * gh * gw, channel * temporal * patch * patch)
    return x.contiguous(), torch.tensor([gt, gh, gw])

"""Encoder configuration: one frozen dataclass, built once (by ``main.config_from_args`` or a test)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.image_files import ENCODE_ENVELOPE_BYTES, MAX_FILE_BYTES
from services.common.ports import DEFAULT_ENCODER_PORT
from services.common.security import NO_SECURITY, InternalSecurity
from services.common.video_files import VideoLimits
from services.common.wire import CHUNK_BYTES
from services.encoder.faults import NO_FAULTS, Faults
from services.encoder.pd_allow import PdAllowSpec

MIB = 1 << 20
_VIDEO = VideoLimits()  # the defaults the proxy's video limits share
DEFAULT_METRICS_PORT = 9101
"""``epd encoder``'s ``--metrics-port`` (``epd up`` gives encoder i 9101 + i)."""


@dataclass(frozen=True)
class EncoderConfig:
    """Everything the encoder process needs; validated on construction."""

    model: str = ""
    """Checkpoint directory or hub id; ``""`` = the built-in tiny model, built on first use."""
    device: str = "auto"
    """Torch device for the vision tower: auto (cuda when present, else cpu), cpu, cuda, cuda:N."""
    dtype: str = "auto"
    """Weight/activation dtype: auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16."""
    linear_backend: str = "auto"
    """Who runs the vision tower's linear layers on CPU in float32: auto, kernel, onednn, torch
    (``services/common/cpu_linear.py``)."""
    host: str = "127.0.0.1"
    port: int = DEFAULT_ENCODER_PORT
    """gRPC port; 0 picks a free one (tests)."""
    metrics_port: int = -1
    """Prometheus ``/metrics`` HTTP port; 0 picks a free one (tests), -1 = off. Off by default in
    code so in-process servers never fight over a port; ``epd encoder`` defaults to ``DEFAULT_METRICS_PORT``."""
    metrics_host: str = ""
    """Address of the ``/metrics`` endpoint; ``""`` = ``host``."""

    max_batch_images: int = 8
    """Most images in one vision forward."""
    max_wait_ms: float = 5.0
    """How long the worker waits for more images after the first one of a batch arrived."""
    max_pending: int = 256
    """Most images queued or being encoded; beyond it Encode answers RESOURCE_EXHAUSTED."""
    max_message_bytes: int = MAX_FILE_BYTES + ENCODE_ENVELOPE_BYTES
    """Largest Encode message taken: gRPC refuses a bigger one with RESOURCE_EXHAUSTED before it is
    parsed. The default holds the largest image file the proxy forwards under its default body limit."""
    cache_bytes: int = 256 * MIB
    """Capacity of the embedding LRU cache (0 disables caching)."""

    max_outbound_bytes: int = 256 * MIB
    """Most embedding bytes being pushed to PDs at once; further pushes wait for room."""
    push_chunk_bytes: int = CHUNK_BYTES
    """Largest raw chunk of a PushEmbedding stream (PD accepts at most 1 MiB)."""
    push_timeout_s: float = 30.0
    """Push deadline when the Encode call itself has none."""
    push_attempts: int = 3
    """Tries per push; a retry happens only when PD never received the header (UNAVAILABLE)."""
    push_connect_timeout_s: float = 2.0
    """Longest wait for the channel to a PD to become ready before one attempt."""

    threads: int = 0
    """Torch intra-op threads; 0 keeps torch's default."""
    warmup: bool = True
    """Run one blank-image encode before reporting ready (first-call kernels, allocator)."""
    grace_s: float = 10.0
    """On SIGTERM, how long in-flight Encode calls may finish before the server stops."""
    stall_timeout_s: float = 120.0
    """Readiness goes off while one vision forward has run this long (the proxy routes around); 0 = off.
    Longer than PD's step bound: on a CPU one 12 MP photo takes about a minute to encode."""
    liveness_timeout_s: float = 600.0
    """Liveness goes off while one vision forward has run this long (``epd up`` or an orchestrator
    restarts the encoder), or for good when the worker thread died; 0 = a dead thread only."""
    faults: Faults = NO_FAULTS
    """Test-only fault injection in the pusher (``faults.py``); none by default."""
    security: InternalSecurity = NO_SECURITY
    """Internal transport: TLS/mTLS and token for the server and the pushes to PDs (``security.py``)."""
    accept_pixel_values: bool = False
    """Take processed pixel tensors (``EncodeItem.pixel_values``, as older proxies sent) besides image files.
    Off: an image's ``mm_hash`` hashes the decoded image, which the encoder checks for a file but cannot for
    processed pixels, so any caller with the token could have an honest encoder embed other pixels under a
    popular image's hash and PD cache them."""
    pd_allow: PdAllowSpec = PdAllowSpec()
    """The PDs an Encode may name (``pd_allow.py``); the default allows loopback addresses only."""
    max_video_frames: int = _VIDEO.max_frames
    """Most frames sampled of one video (the proxy's ``--max-video-frames``: keep them equal)."""
    max_video_seconds: float = _VIDEO.max_seconds
    """Longest video, from its header and its packets (the proxy's ``--max-video-seconds``)."""
    max_video_bytes: int = _VIDEO.max_bytes
    """Largest video file (the proxy's ``--max-video-bytes``)."""
    video_threads: int = 1
    """Videos decoded at once, on threads of their own (``video_decodes.py``)."""
    video_queue: int = 8
    """Encode calls with a video waiting for a decode thread; beyond it RESOURCE_EXHAUSTED."""

    def video_limits(self) -> VideoLimits:
        """What this encoder decodes of one video; a frame's size and the sampled frames' pixels together are
        ``VideoLimits``' defaults, the proxy's default ``--max-image-pixels`` and ``--max-request-pixels``."""
        return VideoLimits(
            max_bytes=self.max_video_bytes, max_seconds=self.max_video_seconds, max_frames=self.max_video_frames
        )

    def __post_init__(self) -> None:
        if self.linear_backend not in ("auto", "torch", "onednn", "kernel"):
            raise ValueError("linear_backend must be auto, torch, onednn or kernel")
        positive = {
            "max_batch_images": self.max_batch_images,
            "max_pending": self.max_pending,
            "max_message_bytes": self.max_message_bytes,
            "max_outbound_bytes": self.max_outbound_bytes,
            "push_chunk_bytes": self.push_chunk_bytes,
            "push_timeout_s": self.push_timeout_s,
            "push_attempts": self.push_attempts,
            "push_connect_timeout_s": self.push_connect_timeout_s,
            "max_video_frames": self.max_video_frames,
            "max_video_seconds": self.max_video_seconds,
            "max_video_bytes": self.max_video_bytes,
            "video_threads": self.video_threads,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        non_negative = {
            "max_wait_ms": self.max_wait_ms,
            "cache_bytes": self.cache_bytes,
            "threads": self.threads,
            "grace_s": self.grace_s,
            "port": self.port,
            "stall_timeout_s": self.stall_timeout_s,
            "liveness_timeout_s": self.liveness_timeout_s,
            "video_queue": self.video_queue,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be -1 (off), 0 (any free port) or a port, got {self.metrics_port}")
        if self.push_chunk_bytes > CHUNK_BYTES:
            raise ValueError(f"push_chunk_bytes must be <= {CHUNK_BYTES} (PD's chunk limit)")

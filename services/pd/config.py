"""PD service configuration: one frozen dataclass, built once from flags."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.dial_allow import PdAllowSpec
from services.common.ports import DEFAULT_PD_PORT
from services.common.security import NO_SECURITY, InternalSecurity
from services.common.video_files import VideoLimits
from services.pd.engine.kv_handoff import DEFAULT_MAX_SHARE_PER_PEER
from services.pd.engine.preallocated import DEFAULT_MAX_PREALLOCATED, DEFAULT_MAX_PREALLOCATED_PER_PEER
from services.pd.engine.step_budget import DEFAULT_MIN_PREFILL_TOKENS
from services.pd.faults import NO_FAULTS, PdFaults
from services.pd.runner.grammar_compile import DEFAULT_CACHE_MB, DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_MAX_PENDING_COMPILES
from services.pd.shared_cores import MAX_HOLD_PERIOD_S

DEFAULT_MAX_KV_BUFFER_MB = 2048
"""``--max-kv-push-buffer-mb``: the KV pushes being received, together (``kv_transfer.py``)."""

_VIDEO = VideoLimits()  # the defaults the proxy's and the encoder's video limits share
DEFAULT_METRICS_PORT = 9201
"""``epd pd``'s ``--metrics-port`` (``epd up`` gives PD j 9201 + j)."""

DEFAULT_MAX_BUFFER_BYTES = 1 << 30
"""Payload bytes of all embedding pushes in flight together (``--max-push-buffer-mb``; ``push_intake.py``)."""
DEFAULT_MAX_PUSHES_PER_PEER = 64
"""Embedding pushes in flight from one caller address (``--max-pushes-per-peer``; ``push_intake.py``)."""
DEFAULT_MAX_CACHE_SUBSCRIBERS = 16
"""SubscribeCacheEvents streams open at once (``--max-cache-subscribers``; ``cache_feed.py``)."""


MAX_IMAGE_HOLD_S = 600.0
"""Most ``--image-hold-s`` may ask: a PD holds its decoding streams that long at worst."""


@dataclass(frozen=True)
class PdConfig:
    """Everything a PD process needs; see ``services/pd/flags.py`` for the flags."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PD_PORT
    # Prometheus /metrics port: 0 = a free one (tests), -1 = off. Off by default in code so
    # in-process servers never fight over a port; ``epd pd`` defaults to DEFAULT_METRICS_PORT.
    metrics_port: int = -1
    metrics_host: str = ""  # "" = host
    threads: int = 0
    linear_backend: str = "auto"  # auto | torch | onednn | kernel (see services/common/cpu_linear.py)
    # KV cache
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 = size from memory (services/pd/runner/kv_sizing.py)
    kv_cache_memory_mb: int = 0  # 0 = 1024 on CPU; on CUDA, what gpu_memory_utilization leaves
    enable_prefix_caching: bool = True
    # GPU engine (services/pd/runner/kv_sizing.py, services/pd/runner/decode_plan.py)
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device this PD may fill (weights, activations, KV)
    # CUDA: capture no graphs; decode-only steps run eagerly. Without it a failed kernel compile or
    # capture refuses start-up (services/pd/runner/decode_plan.py, plan_static_decode).
    enforce_eager: bool = False
    # scheduling
    max_num_batched_tokens: int = 2048  # hard cap of one step's tokens
    # The step budget's targets (services/pd/engine/step_budget.py), milliseconds:
    # inter-token latency: None = auto (a multiple of the predicted decode-only step), 0 = off (the whole cap);
    slo_itl_ms: float | None = None
    # time to first token: None = auto (a multiple of the predicted lone prefill), 0 = off (no deadline share).
    slo_ttft_ms: float | None = None
    min_prefill_tokens: int = DEFAULT_MIN_PREFILL_TOKENS  # prefill every step may take whatever the target
    # A CPU PD beside an encoder holds its steps for an image it awaits, this long at most (0 = never).
    image_hold_s: float = MAX_HOLD_PERIOD_S
    max_num_seqs: int = 64
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 262144  # prompt tokens of all waiting requests
    waiting_retry_after_ms: int = 1000  # retry hint sent when the waiting queue is full
    # embedding hand-off
    embedding_cache_tokens: int = 65536
    max_items_per_request: int = 64  # images (mm items) one Preallocate or Generate may carry
    # Requests holding room from a Preallocate before their Generate: in total, per caller address.
    max_preallocations: int = DEFAULT_MAX_PREALLOCATED
    max_preallocations_per_peer: int = DEFAULT_MAX_PREALLOCATED_PER_PEER
    # Embedding pushes in flight: their payload buffers together (MiB), and how many per caller address.
    max_push_buffer_mb: int = DEFAULT_MAX_BUFFER_BYTES >> 20
    max_pushes_per_peer: int = DEFAULT_MAX_PUSHES_PER_PEER  # KV pushes (PushKV) counted apart, by the same bound
    # KV hand-off, decode side: the buffers of the KV pushes being received (MiB; one larger push is let in
    # alone), and the share of the decode slots and KV blocks one caller's reservations may hold.
    max_kv_push_buffer_mb: int = DEFAULT_MAX_KV_BUFFER_MB
    max_kv_reservation_share: float = DEFAULT_MAX_SHARE_PER_PEER
    # structured outputs (services/pd/runner/grammar.py): how long one constraint may take to compile (longer:
    # refused), how many may wait for a compile, and the MiB the compiled grammars kept may hold.
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    max_pending_grammar_compiles: int = DEFAULT_MAX_PENDING_COMPILES
    grammar_cache_mb: int = DEFAULT_CACHE_MB
    # Generate calls in progress per caller address (waiting and running); 0 = only the queue's own bounds.
    max_requests_per_peer: int = 0
    # SubscribeCacheEvents streams open at once (services/pd/cache_feed.py): the proxies' cache-aware routing.
    max_cache_subscribers: int = DEFAULT_MAX_CACHE_SUBSCRIBERS
    push_idle_timeout_s: float = 10.0  # a PushEmbedding stream that sends nothing this long is ended
    default_lease_ms: int = 30_000
    max_lease_ms: int = 600_000
    lease_sweep_interval_s: float = 0.25
    role: str = "both"  # both | prefill | decode: which side of a KV hand-off this instance serves
    # The decode PDs a hand-off may name, which alone a prefill PD dials (services/common/dial_allow.py);
    # the default allows loopback addresses only.
    decode_allow: PdAllowSpec = PdAllowSpec()
    encoder: str = "remote"  # remote = encoder services push embeddings; local = colocated baseline
    accept_pixel_values: bool = False  # local: also take processed pixels (EncoderConfig.accept_pixel_values)
    # local: what one video may be (the proxy's and the encoder's --max-video-*; keep them equal)
    max_video_frames: int = _VIDEO.max_frames
    max_video_seconds: float = _VIDEO.max_seconds
    max_video_bytes: int = _VIDEO.max_bytes
    # lifecycle
    warmup: bool = True
    grace_s: float = 30.0
    # Readiness watchdog: NOT_SERVING while the step loop has made no progress
    # for this long with work pending (0 = off). Must exceed the longest step.
    stall_timeout_s: float = 60.0
    # Liveness (health service ""): NOT_SERVING once stuck this long (0 = only a dead engine thread counts).
    liveness_timeout_s: float = 300.0
    # internal transport: TLS/mTLS and the token check of this server (services/common/security.py)
    security: InternalSecurity = NO_SECURITY
    faults: PdFaults = NO_FAULTS  # test-only fault injection (services/pd/faults.py); off by default

    def video_limits(self) -> VideoLimits:
        """What a colocated vision side (``--encoder local``) decodes of one video."""
        return VideoLimits(
            max_bytes=self.max_video_bytes, max_seconds=self.max_video_seconds, max_frames=self.max_video_frames
        )

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be positive")
        for name in ("slo_itl_ms", "slo_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be auto (None), 0 (off) or a positive number of milliseconds")
        if self.min_prefill_tokens <= 0:
            raise ValueError("min_prefill_tokens must be positive")
        if not 0 <= self.image_hold_s <= MAX_IMAGE_HOLD_S:
            raise ValueError(f"image_hold_s must be between 0 (never hold) and {MAX_IMAGE_HOLD_S:g} seconds")
        if self.max_waiting_requests <= 0 or self.max_waiting_tokens <= 0 or self.waiting_retry_after_ms <= 0:
            raise ValueError("max_waiting_requests, max_waiting_tokens and waiting_retry_after_ms must be positive")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError("role must be both, prefill or decode")
        if self.role == "decode" and self.encoder == "local":
            raise ValueError("a decode instance runs no prompt, so no vision tower (--encoder local)")
        if self.linear_backend not in ("auto", "torch", "onednn", "kernel"):
            raise ValueError("linear_backend must be auto, torch, onednn or kernel")
        if self.stall_timeout_s < 0 or self.liveness_timeout_s < 0:
            raise ValueError("stall_timeout_s and liveness_timeout_s must be >= 0 (0 = a dead engine thread only)")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be -1 (off), 0 (any free port) or a port")
        if not 0 < self.gpu_memory_utilization <= 1 or self.kv_cache_memory_mb < 0:
            raise ValueError("gpu_memory_utilization must be in (0, 1] and kv_cache_memory_mb >= 0")
        if self.embedding_cache_tokens <= 0:
            raise ValueError("embedding_cache_tokens must be positive")
        if self.max_push_buffer_mb <= 0 or self.max_pushes_per_peer <= 0 or self.max_kv_push_buffer_mb <= 0:
            raise ValueError("max_push_buffer_mb, max_kv_push_buffer_mb and max_pushes_per_peer must be positive")
        if not 0 < self.max_kv_reservation_share <= 1:
            raise ValueError("max_kv_reservation_share must be in (0, 1]")
        if not (
            0 < self.grammar_compile_timeout_s < float("inf")
            and self.max_pending_grammar_compiles > 0
            and self.grammar_cache_mb > 0
        ):
            raise ValueError(
                "grammar_compile_timeout_s, max_pending_grammar_compiles and grammar_cache_mb must be positive"
            )
        if self.max_cache_subscribers <= 0:
            raise ValueError("max_cache_subscribers must be positive")
        if self.max_requests_per_peer < 0:
            raise ValueError("max_requests_per_peer must be >= 0 (0 = off)")
        if self.max_preallocations <= 0 or self.max_preallocations_per_peer <= 0:
            raise ValueError("max_preallocations and max_preallocations_per_peer must be positive")
        if self.max_items_per_request <= 0 or self.push_idle_timeout_s <= 0:
            raise ValueError("max_items_per_request and push_idle_timeout_s must be positive")
        if not 0 < self.default_lease_ms <= self.max_lease_ms:
            raise ValueError("default_lease_ms must be in (0, max_lease_ms]")
        if self.encoder not in ("remote", "local"):
            raise ValueError("encoder must be 'remote' or 'local'")
        if self.max_video_frames <= 0 or self.max_video_seconds <= 0 or self.max_video_bytes <= 0:
            raise ValueError("max_video_frames, max_video_seconds and max_video_bytes must be positive")
        if not 0 < self.lease_sweep_interval_s <= 1.0:
            raise ValueError("lease_sweep_interval_s must be in (0, 1]: leases are swept at least once a second")

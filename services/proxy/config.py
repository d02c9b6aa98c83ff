"""The proxy's configuration: one frozen dataclass, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.ports import DEFAULT_ENCODER_PORT, DEFAULT_PD_PORT
from services.common.security import NO_SECURITY, InternalSecurity
from services.common.video_files import VideoLimits
from services.proxy.backends.cache_index import DEFAULT_MAX_BYTES
from services.proxy.backends.discovery import parse_target
from services.proxy.backends.routing import DEFAULT_CACHE_WEIGHT, DEFAULT_PD_POLICY, ENCODER_POLICIES, PD_POLICIES
from services.proxy.cache_isolation import CacheIsolation
from services.proxy.dispatch.image_window import DEFAULT_IMAGE_WINDOW
from services.proxy.faults import NO_FAULTS, ProxyFaults

MIB = 1024 * 1024
_VIDEO = VideoLimits()  # the video limits' defaults, shared with the encoder's


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs to start; built once (CLI or tests) and passed in.

    Limits protect the proxy itself: every one is checked before work that
    would cost memory or CPU (body size before parsing, pixel count before
    decoding, image count before decoding any).
    """

    model: str = ""  # checkpoint dir or hub id ("" = built-in tiny); processor only
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = pick a free port
    # Each entry: ip:port (one instance), name:port (every address the name resolves
    # to, re-resolved every dns_refresh_s), or a gRPC target with a scheme.
    pd_addresses: tuple[str, ...] = (f"127.0.0.1:{DEFAULT_PD_PORT}",)
    encoder_addresses: tuple[str, ...] = (f"127.0.0.1:{DEFAULT_ENCODER_PORT}",)
    # E+P+D: decode instances (``epd pd --role decode``); pd_addresses are then prefill instances
    # (``--role prefill``), and each request goes to one of each (services/proxy/dispatch/handoff.py). () = E+PD.
    decode_addresses: tuple[str, ...] = ()
    served_model_name: str | None = None  # name in /v1/models and requests; None = adapter.model_id
    request_timeout_s: float = 300.0  # end-to-end deadline of one request, propagated to every RPC;
    # X-Request-Timeout may shorten it per request
    max_body_bytes: int = 32 * MIB
    # time limits besides the deadline (each is also capped by it); 0 = off where noted
    body_timeout_s: float = 30.0  # the whole request body must arrive within this (408, connection closed)
    first_token_timeout_s: float = 0.0  # arrival to PD's first message; 0 = off (the deadline bounds it)
    inter_token_timeout_s: float = 60.0  # longest gap between PD messages of one generation; 0 = off
    encode_timeout_s: float = 300.0  # an Encode call unanswered this long charges its encoder; 0 = off
    write_timeout_s: float = 30.0  # longest one response write may wait for the client to read; 0 = off
    # HTTP server (uvicorn) limits, applied by ``epd proxy`` itself
    max_concurrency: int = 2048  # connections + requests beyond which new requests get 503; 0 = no limit
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_images_per_request: int = 8
    max_messages: int = 2048  # chat messages of one request, bounded before the body is parsed
    max_image_pixels: int = 4096 * 4096  # width × height, read from the header before decoding
    max_request_pixels: int = 2 * 4096 * 4096  # all images of one request together, from their headers
    # one video, checked from its header before decoding (a frame's size is capped by max_image_pixels)
    max_video_frames: int = _VIDEO.max_frames  # sampled frames (also bounds mm_processor_kwargs' frame counts)
    max_video_seconds: float = _VIDEO.max_seconds
    max_video_bytes: int = _VIDEO.max_bytes
    max_model_len: int = 0  # prompt + completion cap; 0 = the model's (match PD's flag)
    max_tokens_limit: int = 16384  # largest max_tokens a client may ask for
    default_max_tokens: int = 1024  # when the client does not say (also capped by context room)
    lease_ms: int = 0  # Preallocate and ReserveKV lease; 0 = the remaining deadline (always <= it)
    preprocess_threads: int = 2  # text work (chat template, tokenization), off the event loop
    text_queue: int = 64  # text jobs waiting for a thread beyond which requests get 503
    image_threads: int = 2  # image work (decode, hash, image processor), its own pool
    image_queue: int = 64  # requests' image jobs waiting beyond which requests get 503
    video_threads: int = 1  # video decoding, its own pool: videos never hold the image threads
    video_queue: int = 8  # requests' video jobs waiting beyond which requests get 503
    max_n: int = 8  # most choices (n) in one request
    # per-client fairness (services/proxy/web/fairness.py); a client is the API key, else the peer address; 0 = off
    max_requests_per_client: int = 0  # requests in flight per client (n choices count as n); beyond it 429
    max_tokens_per_client_per_minute: int = 0  # token bucket over prompt + max_tokens × n; beyond it 429
    # Unknown body fields: True = ignored (as vLLM does), named in the X-EPD-Ignored-Fields header and a
    # log line; False = refused with a 400 naming them (fields we know and do not implement: refused either way).
    ignore_unknown_fields: bool = True
    hide_cache_details: bool = False  # usage carries no cached_tokens, cache hits or stage timings
    # which requests may share cache entries: a per-tenant salt in every cache key (cache_isolation.py)
    cache_isolation: CacheIsolation = CacheIsolation.SHARED
    # routing and failure handling
    pd_policy: str = DEFAULT_PD_POLICY  # see routing.PD_POLICIES
    pd_cache_weight: float = DEFAULT_CACHE_WEIGHT  # cache-aware: a token to compute weighs this many of load
    pd_cache_index_mb: int = DEFAULT_MAX_BYTES // MIB  # cache-aware: memory bound of the index of PD caches
    encoder_policy: str = "rendezvous"  # see routing.ENCODER_POLICIES
    encoder_saturation: int = 16  # images in flight beyond which an encoder's affinity yields
    # image requests per PD between their Preallocate and their first token (dispatch/image_window.py; 0 = no bound)
    pd_image_window: int = DEFAULT_IMAGE_WINDOW
    pd_attempts: int = 3  # PDs one request may try (before its first byte)
    encoder_attempts: int = 3  # encoders one image may try
    breaker_failures: int = 3  # consecutive failures that open an instance's breaker
    breaker_open_s: float = 2.0  # how long an open breaker keeps traffic away before a probe
    load_poll_s: float = 0.5  # GetLoad polling period (0 = own in-flight counts only)
    dns_refresh_s: float = 5.0  # re-resolution period of named targets
    # access and remote media
    api_key: str | None = field(default=None, repr=False)  # required as "Authorization: Bearer <key>" when set
    # https image URLs may come from these hosts ("*.x" = its subdomains); () = data URLs only
    allowed_media_domains: tuple[str, ...] = ()
    media_timeout_s: float = 10.0  # one remote image fetch (also capped by the request deadline)
    max_media_bytes: int = 16 * MIB  # largest remote image
    faults: ProxyFaults = NO_FAULTS  # test-only fault injection (services/proxy/faults.py); off by default
    # internal transport to encoders and PDs: TLS/mTLS and the token (services/common/security.py)
    security: InternalSecurity = NO_SECURITY
    # The scrape port: /metrics on its own listener (behind the internal token with
    # security.metrics_auth), and none on the public port; 0 = a free one (tests), -1 = off
    # (/metrics on the public port, behind the API key when one is set).
    metrics_port: int = -1
    metrics_host: str = ""  # "" = host

    def video_limits(self) -> VideoLimits:
        """The bounds of one video (``--max-video-*``; a frame's size is an image's, ``--max-image-pixels``, and
        its sampled frames together are at most a request's images, ``--max-request-pixels``)."""
        return VideoLimits(
            max_bytes=self.max_video_bytes,
            max_seconds=self.max_video_seconds,
            max_frames=self.max_video_frames,
            max_frame_pixels=self.max_image_pixels,
            max_total_pixels=self.max_request_pixels,
        )

    def __post_init__(self) -> None:
        # Normalise lists passed by callers into tuples so the config stays hashable.
        object.__setattr__(self, "pd_addresses", tuple(self.pd_addresses))
        object.__setattr__(self, "encoder_addresses", tuple(self.encoder_addresses))
        object.__setattr__(self, "decode_addresses", tuple(self.decode_addresses))
        object.__setattr__(self, "allowed_media_domains", tuple(d.strip().lower() for d in self.allowed_media_domains))
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError("metrics_port must be -1 (off), 0 (any free port) or a port")
        if not self.pd_addresses:
            raise ValueError("at least one PD address is required")
        for address in self.pd_addresses + self.encoder_addresses + self.decode_addresses:
            parse_target(address)
        if len(set(self.decode_addresses)) != len(self.decode_addresses) or set(self.decode_addresses) & set(
            self.pd_addresses
        ):
            raise ValueError("decode addresses must be distinct, and distinct from the PD (prefill) addresses")
        if len(set(self.pd_addresses)) != len(self.pd_addresses):
            raise ValueError("PD addresses must be distinct")
        if len(set(self.encoder_addresses)) != len(self.encoder_addresses):
            raise ValueError("encoder addresses must be distinct")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        positive = {
            "request_timeout_s": self.request_timeout_s,
            "max_body_bytes": self.max_body_bytes,
            "max_messages": self.max_messages,
            "max_image_pixels": self.max_image_pixels,
            "max_request_pixels": self.max_request_pixels,
            "max_video_frames": self.max_video_frames,
            "max_video_seconds": self.max_video_seconds,
            "max_video_bytes": self.max_video_bytes,
            "image_threads": self.image_threads,
            "video_threads": self.video_threads,
            "max_tokens_limit": self.max_tokens_limit,
            "default_max_tokens": self.default_max_tokens,
            "preprocess_threads": self.preprocess_threads,
            "max_n": self.max_n,
            "encoder_saturation": self.encoder_saturation,
            "pd_attempts": self.pd_attempts,
            "encoder_attempts": self.encoder_attempts,
            "breaker_failures": self.breaker_failures,
            "breaker_open_s": self.breaker_open_s,
            "dns_refresh_s": self.dns_refresh_s,
            "media_timeout_s": self.media_timeout_s,
            "max_media_bytes": self.max_media_bytes,
            "body_timeout_s": self.body_timeout_s,
            "keep_alive_timeout_s": self.keep_alive_timeout_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0")
        stall_bounds = (
            self.first_token_timeout_s,
            self.inter_token_timeout_s,
            self.write_timeout_s,
            self.encode_timeout_s,
        )
        if any(not bound >= 0 for bound in stall_bounds) or self.max_concurrency < 0:
            raise ValueError(
                "first_token_timeout_s, inter_token_timeout_s, write_timeout_s, encode_timeout_s and max_concurrency must be >= 0"
            )
        if self.max_requests_per_client < 0 or self.max_tokens_per_client_per_minute < 0:
            raise ValueError("max_requests_per_client and max_tokens_per_client_per_minute must be >= 0 (0 = off)")
        if self.text_queue < 0 or self.image_queue < 0 or self.video_queue < 0:
            raise ValueError("text_queue, image_queue and video_queue must be >= 0")
        if self.max_images_per_request < 0:
            raise ValueError("max_images_per_request must be >= 0 (0 = text only)")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")
        if self.lease_ms < 0 or self.load_poll_s < 0 or self.max_model_len < 0 or self.pd_image_window < 0:
            raise ValueError("lease_ms, load_poll_s, max_model_len and pd_image_window must be >= 0")
        if not self.pd_cache_weight >= 0 or self.pd_cache_index_mb <= 0:
            raise ValueError("pd_cache_weight must be >= 0 and pd_cache_index_mb > 0")
        if self.pd_policy not in PD_POLICIES:
            raise ValueError(f"pd_policy must be one of {', '.join(PD_POLICIES)}")
        if self.encoder_policy not in ENCODER_POLICIES:
            raise ValueError(f"encoder_policy must be one of {', '.join(ENCODER_POLICIES)}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be blank")
        if any(not d or "/" in d or d.startswith("*") and not d.startswith("*.") for d in self.allowed_media_domains):
            raise ValueError("allowed_media_domains entries must be host names or *.domain patterns")
        if self.lease_ms > self.request_timeout_s * 1000:
            raise ValueError("lease_ms must not exceed the request timeout")

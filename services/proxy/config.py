"""The proxy's configuration: one frozen dataclass, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


def _check_address(address: str) -> None:
    """Accepts ``host:port`` (IPv6 as ``[::1]:port``) or a gRPC target with a scheme."""
    if "://" in address or address.startswith("unix:"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"backend address must be host:port, got {address!r}")


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs to start; built once (CLI or tests) and passed in.

    Limits protect the proxy itself: every one is checked before work that
    would cost memory or CPU (body size before parsing, pixel count before
    decoding, image count before decoding any).
    """

    model: str = ""                              # checkpoint dir or hub id ("" = built-in tiny); processor only
    host: str = "127.0.0.1"
    port: int = 8000                             # 0 = pick a free port
    pd_addresses: tuple[str, ...] = ("127.0.0.1:50061",)
    encoder_addresses: tuple[str, ...] = ("127.0.0.1:50051",)
    served_model_name: str | None = None         # name in /v1/models and requests; None = adapter.model_id
    request_timeout_s: float = 300.0             # end-to-end deadline of one request, propagated to every RPC
    max_body_bytes: int = 32 * MIB
    max_images_per_request: int = 8
    max_image_pixels: int = 4096 * 4096          # width × height, read from the header before decoding
    max_model_len: int = 0                       # prompt + completion cap; 0 = the model's (match PD's flag)
    max_tokens_limit: int = 16384                # largest max_tokens a client may ask for
    default_max_tokens: int = 1024               # when the client does not say (also capped by context room)
    lease_ms: int = 0                            # Preallocate lease; 0 = PD default (always <= the deadline)
    preprocess_threads: int = 2                  # image decoding + tokenization run off the event loop
    instance_cooldown_s: float = 2.0             # an UNAVAILABLE instance is tried last for this long
    health_timeout_s: float = 1.0                # per-instance timeout of /health checks

    def __post_init__(self) -> None:
        # Normalise lists passed by callers into tuples so the config stays hashable.
        object.__setattr__(self, "pd_addresses", tuple(self.pd_addresses))
        object.__setattr__(self, "encoder_addresses", tuple(self.encoder_addresses))
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if not self.pd_addresses:
            raise ValueError("at least one PD address is required")
        for address in self.pd_addresses + self.encoder_addresses:
            _check_address(address)
        if len(set(self.pd_addresses)) != len(self.pd_addresses):
            raise ValueError("PD addresses must be distinct")
        if len(set(self.encoder_addresses)) != len(self.encoder_addresses):
            raise ValueError("encoder addresses must be distinct")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        positive = {
            "request_timeout_s": self.request_timeout_s,
            "max_body_bytes": self.max_body_bytes,
            "max_image_pixels": self.max_image_pixels,
            "max_tokens_limit": self.max_tokens_limit,
            "default_max_tokens": self.default_max_tokens,
            "preprocess_threads": self.preprocess_threads,
            "health_timeout_s": self.health_timeout_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_images_per_request < 0:
            raise ValueError("max_images_per_request must be >= 0 (0 = text only)")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")
        if self.lease_ms < 0 or self.instance_cooldown_s < 0 or self.max_model_len < 0:
            raise ValueError("lease_ms, instance_cooldown_s and max_model_len must be >= 0")
        if self.lease_ms > self.request_timeout_s * 1000:
            raise ValueError("lease_ms must not exceed the request timeout")

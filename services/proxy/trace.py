"""One request's id and what the proxy measures about it, from arrival to its last PD message.

Shared below the wings: the shell starts a ``Trace`` when a request arrives, ``dispatch`` fills in its
backend timings and counts, ``openai.responses`` reports it as ``usage.epd`` and ``web.middleware`` names
requests with ``new_request_id``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


def new_request_id(prefix: str = "chatcmpl") -> str:
    """A fresh, unguessable request id (also the OpenAI response id)."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Trace:
    """Proxy-side measurements of one request (reported as ``usage.epd``)."""

    started: float = field(default_factory=time.monotonic)
    preprocess_ms: float = 0.0
    window_ms: float | None = None  # waiting for room in the PD's image window (``dispatch/image_window.py``)
    preallocate_ms: float | None = None
    encode_ms: float | None = None  # wall time of the slowest Encode call
    first_token_ms: float | None = None  # arrival -> first PD message
    num_images_ready: int = 0  # already on PD at Preallocate (no encode)
    num_encoder_cache_hits: int = 0
    num_pd_attempts: int = 0
    num_encoder_retries: int = 0
    pd_address: str | None = None
    # The cache-aware policy's decision for the PD chosen (``RouteDecision``): why, and the prompt tokens it held.
    route_reason: str | None = None
    route_hit_tokens: int | None = None

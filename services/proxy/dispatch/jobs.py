"""One generation request as the pipeline sees it, and what the proxy measures about it."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from services.common.pb import epd_pb2
from services.proxy.prompt.preprocess import Prompt


def new_request_id(prefix: str = "chatcmpl") -> str:
    """A fresh, unguessable request id (also the OpenAI response id)."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Trace:
    """Proxy-side measurements of one request (reported as ``usage.epd``)."""

    started: float = field(default_factory=time.monotonic)
    preprocess_ms: float = 0.0
    preallocate_ms: float | None = None
    encode_ms: float | None = None  # wall time of the slowest Encode call
    first_token_ms: float | None = None  # arrival -> first PD message
    num_images_ready: int = 0  # already on PD at Preallocate (no encode)
    num_encoder_cache_hits: int = 0
    num_pd_attempts: int = 0
    num_encoder_retries: int = 0
    pd_address: str | None = None


@dataclass
class Job:
    """One generation request as the pipeline sees it."""

    request_id: str
    prompt: Prompt
    sampling: epd_pb2.SamplingParams
    deadline: float  # time.monotonic() value
    trace: Trace = field(default_factory=Trace)
    decodes_tried: set[str] = field(default_factory=set)  # E+P+D: decode instances that failed this job

    def generate_request(self, request_id: str, **handoff: object) -> epd_pb2.GenerateRequest:
        """The Generate of attempt ``request_id``; ``handoff``: E+P+D's ``kv_handoff`` or ``kv_reservation_id``."""
        return epd_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=self.prompt.token_ids,
            mm_items=self.prompt.mm_items_pb(),
            sampling=self.sampling,
            cache_salt=self.prompt.cache_salt,
            **handoff,  # type: ignore[arg-type]
        )

    def attempt_id(self, number: int) -> str:
        """PD request id of attempt ``number``: a retry never reuses an id."""
        return self.request_id if number == 0 else f"{self.request_id}-r{number}"

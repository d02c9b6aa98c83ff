"""One generation request as the pipeline sees it (its measurements: ``services.proxy.trace``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from services.common.pb import epd_pb2
from services.proxy.backends.cache_index import PromptImage, RoutedPrompt
from services.proxy.prompt.preprocess import Prompt
from services.proxy.trace import Trace


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

    @functools.cached_property
    def route(self) -> RoutedPrompt:
        """The prompt as PD routing sees it (the cache-aware policy hashes its blocks once, on demand)."""
        prompt = self.prompt
        images = tuple(
            PromptImage(i.mm_hash, i.offset, i.num_tokens, i.token_grid, i.frame_offsets) for i in prompt.images
        )
        return RoutedPrompt(prompt.token_ids, images, prompt.cache_salt)

    def attempt_id(self, number: int) -> str:
        """PD request id of attempt ``number``: a retry never reuses an id."""
        return self.request_id if number == 0 else f"{self.request_id}-r{number}"

"""The output side of admitted requests: detokenizers and the events not handed out yet.

The engine core opens a stream when Generate admits a request, adds each
sampled token, and closes the stream with the request's last event. Whoever
runs the core takes the events after every step (``take``). Pure Python.
"""

from __future__ import annotations

from typing import Any

from services.pd.engine.detokenizer import IncrementalDetokenizer
from services.pd.engine.outputs import Event, RequestEvent, SampledToken, TokenDelta
from services.pd.engine.request import Request, RequestStatus


class RequestStreams:
    """One detokenizer per admitted request, and the queue of events produced since the last ``take``."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._events: list[RequestEvent] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._detokenizers

    def __len__(self) -> int:
        return len(self._detokenizers)

    @property
    def request_ids(self) -> list[str]:
        return list(self._detokenizers)

    @property
    def has_events(self) -> bool:
        return bool(self._events)

    def open(self, request: Request) -> None:
        sampling = request.sampling
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self._tokenizer,
            request.prompt_token_ids,
            sampling.stop,
            sampling.skip_special_tokens,
            sampling.min_tokens,
            spaces_between_special_tokens=sampling.spaces_between_special_tokens,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
        )

    def add_token(self, request: Request, sampled: SampledToken) -> bool:
        """Queues the token's text delta; True when it completed a stop string.

        A request already finished (its last token) gets the text held back
        for a possible stop string too. The token that stopped it (EOS or a
        stop token: the only way a request is ``FINISHED_STOPPED`` before its
        text is read) adds no text unless ``include_stop_str_in_output``, as
        in vLLM; its id is reported all the same.
        """
        detokenizer = self._detokenizers[request.request_id]
        stop_token = request.status is RequestStatus.FINISHED_STOPPED
        decoded = [] if stop_token and not request.sampling.include_stop_str_in_output else [sampled.token_id]
        text, stopped = detokenizer.add_tokens(decoded)
        if request.is_finished and not stopped:
            text += detokenizer.flush()
        logprobs = [sampled] if request.sampling.logprobs is not None else []
        self._events.append(RequestEvent(request.request_id, TokenDelta([sampled.token_id], text, logprobs)))
        return stopped

    def close(self, request_id: str, event: Event) -> None:
        """Queues the request's last event and forgets it; no-op when it has no stream."""
        if self._detokenizers.pop(request_id, None) is not None:
            self._events.append(RequestEvent(request_id, event))

    def take(self) -> list[RequestEvent]:
        """The events produced since the last call, in order."""
        events, self._events = self._events, []
        return events

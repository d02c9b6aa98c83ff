"""The Encode calls of a job's attempts, and what every backend call of a job shares.

``Calls`` is all an attempt (``attempt.py``) needs besides its PD: ``encode_image`` sends one image
that PD reserved to the best encoder for it, moving to the next in its ranking when one fails (same
reservation: nothing was filled); ``remaining`` is what is left of the job's one deadline (every call's
gRPC timeout); ``lease_ms`` is how long PD holds a reservation for those Encodes; ``windows`` bounds the
image requests per PD between their Preallocate and their first token (``image_window.py``). The job loop
(``pipeline.py``) builds one and hands it to each attempt, so an attempt never calls back into the loop
that runs it.

``BackendError``, ``note_retry`` and ``retry_after_s`` serve the job loop and E+P+D (``handoff.py``) too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from services.common import grpc_utils
from services.common.pb import epd_pb2
from services.proxy.backends.instances import Instance, Outcome, outcome_of
from services.proxy.backends.pools import Backends
from services.proxy.dispatch.image_window import ImageWindows
from services.proxy.dispatch.jobs import Job
from services.proxy.errors import from_grpc, no_backend
from services.proxy.metrics import ProxyMetrics
from services.proxy.prompt.preprocess import ImageItem

log = logging.getLogger(__name__)

S = grpc.StatusCode
_ENCODER_RETRY_CODES = frozenset({S.UNAVAILABLE, S.RESOURCE_EXHAUSTED, S.INTERNAL, S.UNKNOWN, S.ABORTED})
"""Not retried: bad input (same everywhere), deadline (spent), PD-side reservation errors."""
DEFAULT_BUSY_S = 1.0
"""How long an instance that said RESOURCE_EXHAUSTED without a hint counts as busy."""


class BackendError(Exception):
    """A backend call failed; keeps the gRPC error and which instance gave it.

    ``pd_push``: the encoder reported that its push to PD failed (PD's hop, not the encoder's).
    """

    def __init__(self, error: grpc.aio.AioRpcError, instance: Instance, *, pd_push: bool = False) -> None:
        super().__init__(error.code().name)
        self.error = error
        self.code = error.code()
        self.instance = instance
        self.pd_push = pd_push


class Calls:
    """The Encode calls, deadline and lease of a pipeline's attempts; one per pipeline.

    ``encode_s``: the bound on one Encode call (0 = none but the deadline); an encoder that takes
    longer is charged for it (its circuit breaker), as a request deadline that runs out never is.
    ``image_window``: image requests per PD between their Preallocate and their first token (0 = no bound).
    """

    def __init__(
        self,
        backends: Backends,
        *,
        metrics: ProxyMetrics,
        lease_ms: int = 0,
        encoder_attempts: int = 3,
        encode_s: float = 0.0,
        image_window: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backends = backends
        self.windows = ImageWindows(image_window)
        self.metrics = metrics
        self.encoder_attempts = encoder_attempts
        self.encode_s = encode_s
        self._lease_ms = lease_ms
        self._clock = clock

    def remaining(self, job: Job) -> float:
        """Seconds left before the job's deadline; a spent deadline ends the request (504)."""
        left = job.deadline - self._clock()
        if left <= 0:
            raise from_grpc(grpc.StatusCode.DEADLINE_EXCEEDED)
        return left

    def lease_ms(self, job: Job) -> int:
        """The configured lease, never past the deadline; with none configured, the deadline itself.

        (0 would mean PD's default lease, which knows nothing of this request's
        deadline: a request with a longer deadline would lose its reservation early.)
        """
        left_ms = int(self.remaining(job) * 1000)
        return max(1, min(self._lease_ms or left_ms, left_ms))

    async def enter_window(self, job: Job, pd_address: str) -> None:
        """Waits, within the job's deadline, until an image request of ``job`` may start on that PD
        (``windows``; the caller leaves it at its first token or its end)."""
        begin = time.monotonic()
        try:
            async with asyncio.timeout(self.remaining(job)):
                await self.windows.enter(pd_address)
        except TimeoutError:
            raise from_grpc(S.DEADLINE_EXCEEDED) from None
        job.trace.window_ms = (job.trace.window_ms or 0.0) + (time.monotonic() - begin) * 1000

    async def encode_image(
        self, job: Job, request_id: str, pd_address: str, image: ImageItem, reservation_id: str
    ) -> None:
        """Encodes one image for the PD at ``pd_address`` (attempt ``request_id`` of ``job``), moving to the
        next encoder when one fails."""
        request = epd_pb2.EncodeRequest(
            request_id=request_id,
            pd_address=pd_address,
            items=[image.encode_item_pb(reservation_id)],
            cache_salt=job.prompt.cache_salt,
        )
        tried: list[str] = []
        last: BackendError | None = None
        begin = time.monotonic()
        for _ in range(self.encoder_attempts):
            candidates = self.backends.encoder_candidates(image.mm_hash, exclude=tried, pd_address=pd_address)
            if not candidates:
                break
            encoder = candidates[0]
            tried.append(encoder.address)
            outcome, status = Outcome.NEUTRAL, "CANCELLED"
            probe = encoder.begin()
            remaining = self.remaining(job)
            bounded = 0 < self.encode_s < remaining  # the encoder's bound ends the call, not the deadline
            try:
                reply = await encoder.encode(request, timeout=self.encode_s if bounded else remaining)
                outcome, status = Outcome.SUCCESS, "OK"
            except grpc.aio.AioRpcError as error:
                pd_push = grpc_utils.failed_hop(error) == grpc_utils.PUSH_HOP
                stalled = bounded and error.code() == S.DEADLINE_EXCEEDED
                outcome, status = (Outcome.NEUTRAL if pd_push else outcome_of(error.code())), error.code().name
                if stalled:
                    outcome = Outcome.FAILURE
                    self.metrics.stalls.labels("encode").inc()
                if error.code() == S.RESOURCE_EXHAUSTED:
                    encoder.mark_busy(retry_after_s(error))
                if pd_push or (error.code() not in _ENCODER_RETRY_CODES and not stalled):
                    raise BackendError(error, encoder, pd_push=pd_push) from None
                job.trace.num_encoder_retries += 1
                note_retry(self.metrics, encoder, error.code(), request_id)
                last = BackendError(error, encoder)
                continue
            finally:
                encoder.end(outcome, probe=probe)
                self.metrics.backend_requests.labels("encoder", encoder.address, status).inc()
            job.trace.encode_ms = max(job.trace.encode_ms or 0.0, (time.monotonic() - begin) * 1000)
            hits = sum(1 for item in reply.items if item.cache_hit)
            job.trace.num_encoder_cache_hits += hits
            self.metrics.image_sources.labels("encoder_cache" if hits else "encoded").inc()
            return
        if last is None:
            raise no_backend("encoder")
        raise last


def note_retry(metrics: ProxyMetrics, instance: Instance, code: grpc.StatusCode, request_id: str) -> None:
    """Logs and counts a call that moves to another instance (``epd_proxy_retries_total``)."""
    log.info("request %s: %s %s answered %s; trying another", request_id, instance.kind, instance.address, code.name)
    metrics.retries.labels(instance.kind, code.name).inc()


def retry_after_s(error: grpc.aio.AioRpcError) -> float:
    """How long the instance that gave ``error`` (RESOURCE_EXHAUSTED) counts as busy: its hint, else ``DEFAULT_BUSY_S``."""
    hint = grpc_utils.retry_after_ms(error)
    return DEFAULT_BUSY_S if hint is None else hint / 1000

"""The request flow across PD and encoders (DESIGN §3), independent of HTTP.

Text-only: PD ``Generate`` directly. With images: ``Preallocate`` on PD
(no encoder work before PD has room), then PD ``Generate`` and one
``Encode`` per reserved image run concurrently, each image on its own
best encoder; the encoders push the embeddings straight to that PD.

Failure handling, all within the job's one deadline (the gRPC timeout of
every call is what is left of it):

- an image whose encoder fails or is unreachable is retried on the next
  encoder in its ranking (same reservation: nothing was filled);
- a PD that refuses (RESOURCE_EXHAUSTED) or is unreachable before the first
  token reached the caller is replaced by the next PD, always with a fresh
  request id; a buffered (non-streaming) job may also restart on another PD
  after a mid-stream UNAVAILABLE, since the client has seen nothing yet;
- every call's outcome feeds the instance's circuit breaker; a Generate
  stream gives its verdict at its first message, so a half-open probe lasts
  until the first token, not the whole generation;
- an Encode that failed in the encoder's push to PD (``epd-failed-hop:
  pd-push``) is charged to that PD, not the encoder, and moves the job to
  another PD when PD was unreachable.

Every exit path (finish, error, cancellation, client gone) cancels the
Generate stream and the Encode calls; any exit but a clean finish also
sends PD ``Abort`` (idempotent), from a task that survives the caller's
cancellation. The caller waits for that cleanup only briefly and never past
its deadline, so a hung PD's 504 leaves at the deadline, not after the
Abort's own timeout.

Besides the deadline, two optional stall bounds (``StallLimits``) end a
generation whose PD stops producing: no first message within
``first_token_s`` of the request's arrival, or a gap longer than
``inter_token_s`` between messages. Either is a 504 (``stalled``), and the
generation is aborted on PD like any other failure.

One try of a job on one PD is an ``Attempt`` (``attempt.py``); the Encode
calls, the deadline and the lease it uses are the pipeline's ``Calls``
(``calls.py``), handed to every attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from services.common import grpc_utils
from services.common.pb import epd_pb2
from services.proxy.backends.instances import PdClient, outcome_of
from services.proxy.backends.pools import Backends
from services.proxy.dispatch.attempt import Attempt
from services.proxy.dispatch.calls import BackendError, Calls, note_retry, retry_after_s
from services.proxy.dispatch.jobs import Job
from services.proxy.errors import ApiError, from_grpc, internal_error, missing_extra, no_backend, stalled
from services.proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

S = grpc.StatusCode
_PD_RETRY_CODES = frozenset({S.RESOURCE_EXHAUSTED, S.UNAVAILABLE})
CLEANUP_WAIT_S = 1.0
"""Longest a failed or cancelled attempt waits for its cleanup (Abort) before its caller moves on;
never past the job's deadline. The cleanup itself goes on in the background (Abort has its own timeout)."""


@dataclass(frozen=True)
class StallLimits:
    """How long a PD may go without producing, besides the request's deadline (0 = no bound).

    ``first_token_s``: from the request's arrival to the first PD message
    (Preallocate and Encode included). ``inter_token_s``: between two
    consecutive PD messages of one generation. ``encode_s``: one Encode call;
    an encoder that takes longer is charged for it (its circuit breaker), as a
    request deadline that runs out never is.
    """

    first_token_s: float = 0.0
    inter_token_s: float = 0.0
    encode_s: float = 0.0


class Pipeline:
    """Runs jobs against the backends; one instance per app."""

    def __init__(
        self,
        backends: Backends,
        *,
        lease_ms: int = 0,
        pd_attempts: int = 3,
        encoder_attempts: int = 3,
        image_window: int = 0,
        metrics: ProxyMetrics | None = None,
        stall_limits: StallLimits = StallLimits(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backends = backends
        self.stall_limits = stall_limits
        self.pd_attempts = pd_attempts
        self.metrics = metrics or ProxyMetrics()
        self._clock = clock
        self._cleanups: set[asyncio.Task] = set()  # strong refs: cleanup outlives a cancelled caller
        # What attempts call besides their PD (the Encodes, the deadline, the lease): never this loop.
        self.calls = Calls(
            backends,
            metrics=self.metrics,
            lease_ms=lease_ms,
            encoder_attempts=encoder_attempts,
            encode_s=stall_limits.encode_s,
            image_window=image_window,
            clock=clock,
        )

    @contextlib.asynccontextmanager
    async def _stall_bound(
        self, job: Job, limit_s: float, kind: str, since: float | None = None
    ) -> AsyncIterator[None]:
        """Ends the block with a 504 (``stalled``) after ``limit_s`` from ``since`` (default now).

        No bound when ``limit_s`` is 0 or would fall after the deadline (the
        deadline's own 504 comes first then).
        """
        now = self._clock()
        left = (now if since is None else since) + limit_s - now
        if limit_s <= 0 or now + left >= job.deadline:
            yield
            return
        try:
            async with asyncio.timeout(max(left, 0.0)):
                yield
        except TimeoutError:
            self.metrics.stalls.labels(kind).inc()
            log.warning("request %s: no %s from PD within %.1f s", job.request_id, kind.replace("_", "-"), limit_s)
            raise stalled(kind, limit_s) from None

    async def generate(self, job: Job, *, buffered: bool = False) -> AsyncGenerator[epd_pb2.GenerateResponse, None]:
        """Yields PD messages up to and including the one with ``finish_reason``.

        ``buffered``: collect the whole result before yielding anything, which
        lets a PD that dies mid-generation be replaced (the caller has seen
        nothing). Raises ``ApiError`` (mapped from gRPC status codes) on any
        failure, before or after the first message.
        """
        if job.prompt.images and not self.backends.has_encoders:
            raise ApiError(503, "No encoder is configured for image requests.", "server_error", "backend_unavailable")
        tried: set[str] = set()
        while True:
            attempt = await self._admit(job, tried)
            kept: list[epd_pb2.GenerateResponse] = []
            try:
                message = attempt.first
                while message is not None:
                    if buffered:
                        kept.append(message)
                    else:
                        yield message
                    if attempt.finished:
                        break
                    async with self._stall_bound(job, self.stall_limits.inter_token_s, "inter_token"):
                        message = await attempt.next()
                else:
                    raise internal_error("The model server ended the stream without a result.")
            except grpc.aio.AioRpcError as error:
                attempt.fail(error)
                if buffered and error.code() == S.UNAVAILABLE and job.trace.num_pd_attempts < self.pd_attempts:
                    note_retry(self.metrics, attempt.streaming, error.code(), attempt.request_id)
                    if attempt.pd_is_innocent:  # E+P+D: the decode instance's stream broke, not the prefill's
                        tried.discard(attempt.pd.address)
                    continue  # (the finally below releases this attempt first)
                raise self._to_api_error(error, attempt.request_id) from None
            except BackendError as failure:
                raise self._to_api_error(failure.error, attempt.request_id, what=failure.instance.kind) from None
            finally:
                await self._finish(attempt)
            for message in kept:
                yield message
            return

    async def _admit(self, job: Job, tried: set[str]) -> Attempt:
        """Starts the job on the best PD not tried yet, failing over on refusals and outages."""
        last: BackendError | None = None
        while job.trace.num_pd_attempts < self.pd_attempts:
            candidates = self.backends.pd_candidates(exclude=tried, prompt=job.route)
            if not candidates:
                break
            pd = candidates[0]
            cached_tokens = self._note_route(job, pd)
            tried.add(pd.address)
            attempt = self.new_attempt(job, pd, job.attempt_id(job.trace.num_pd_attempts), cached_tokens)
            job.trace.num_pd_attempts += 1
            job.trace.pd_address = pd.address
            try:
                async with self._stall_bound(job, self.stall_limits.first_token_s, "first_token", job.trace.started):
                    await attempt.start()
                job.trace.first_token_ms = (time.monotonic() - job.trace.started) * 1000
                return attempt
            except grpc.aio.AioRpcError as error:
                attempt.fail(error)
                await self._finish(attempt)
                if attempt.pd_is_innocent:  # another hop failed (E+P+D: the decode instance): PD may serve again
                    tried.discard(pd.address)
                if error.code() == S.RESOURCE_EXHAUSTED and not attempt.pd_is_innocent:
                    pd.mark_busy(retry_after_s(error))
                if error.code() not in _PD_RETRY_CODES:
                    raise self._to_api_error(error, attempt.request_id) from None
                if not attempt.pd_is_innocent:  # (the instance at fault counted its own retry)
                    note_retry(self.metrics, pd, error.code(), attempt.request_id)
                last = BackendError(error, pd)
            except BackendError as failure:
                if failure.pd_push:  # PD's hop failed: PD answers for it
                    attempt.outcome, attempt.status = outcome_of(failure.code), failure.code.name
                await self._finish(attempt)
                # Encoders that cannot reach a PD (gone away, or cut off from the
                # encoders): the PD is the cause, so the job moves on like after a PD outage.
                pd_is_the_cause = failure.pd_push or not pd.routable()
                if failure.code != S.UNAVAILABLE or not pd_is_the_cause:
                    raise self._to_api_error(failure.error, attempt.request_id, what=failure.instance.kind) from None
                note_retry(self.metrics, pd, failure.code, attempt.request_id)
                last = failure
            except BaseException:
                await self._finish(attempt)
                raise
        if last is None:
            raise no_backend("PD")
        raise self._to_api_error(last.error, job.request_id)

    def _note_route(self, job: Job, pd: PdClient) -> int:
        """Counts the cache-aware policy's decision for ``pd`` (none from the other policies); returns the
        prompt tokens it found in ``pd``'s caches (0 without a decision)."""
        decision = job.route.decision
        job.route.decision = None
        if decision is None or decision.address != pd.address:
            return 0
        job.trace.route_reason, job.trace.route_hit_tokens = decision.reason, decision.hit_tokens
        self.metrics.route_decisions.labels(decision.reason).inc()
        self.metrics.route_prompt_tokens.inc(job.route.num_tokens)
        self.metrics.route_hit_tokens.inc(decision.hit_tokens)
        log.debug(
            "request %s: pd %s (%s): holds %d of %d prompt tokens (best %d), load %d tokens",
            job.request_id,
            pd.address,
            decision.reason,
            decision.hit_tokens,
            job.route.num_tokens,
            decision.best_hit_tokens,
            decision.load_tokens,
        )
        return decision.hit_tokens

    def new_attempt(self, job: Job, pd: PdClient, request_id: str, cached_tokens: int = 0) -> Attempt:
        """One try of ``job`` on ``pd`` (E+P+D's pipeline tries a prefill and a decode instance);
        ``cached_tokens``: what the routing found of its prompt in ``pd``'s caches."""
        return Attempt(self.calls, job, pd, request_id, cached_tokens)

    def _to_api_error(self, error: grpc.aio.AioRpcError, request_id: str, what: str = "pd") -> ApiError:
        code = error.code()
        # Backend details are ours (no client input), but keep them out of the
        # HTTP body anyway; the log has them for operators. Shedding load is
        # routine (one line per refusal at WARNING would flood the log under overload).
        level = logging.INFO if code == S.RESOURCE_EXHAUSTED else logging.WARNING
        log.log(level, "request %s: %s failed with %s: %.200s", request_id, what, code.name, error.details() or "")
        extra = grpc_utils.missing_extra(error) if code == S.FAILED_PRECONDITION else None
        refusal = missing_extra(extra) if extra is not None else None
        if refusal is not None:  # a feature the model server's install lacks: the client's 400, said plainly
            return refusal
        return from_grpc(code, grpc_utils.retry_after_ms(error) if code == S.RESOURCE_EXHAUSTED else None)

    async def _finish(self, attempt: Attempt) -> None:
        """Stops the attempt; Abort on PD unless it finished cleanly. Survives cancellation."""
        tasks = attempt.stop()
        attempt.count(self.metrics)
        if attempt.job.trace.num_images_ready and attempt.finished:
            self.metrics.image_sources.labels("pd_cache").inc(attempt.job.trace.num_images_ready)
        needs_abort = attempt.started_rpc and not attempt.finished

        async def cleanup() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            if needs_abort:
                await attempt.abort()

        task = asyncio.create_task(cleanup())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        # Usually the Abort is back in a millisecond and PD is released before the
        # client hears anything; a hung PD must not hold the answer past the deadline.
        wait_s = min(CLEANUP_WAIT_S, max(0.0, attempt.job.deadline - self._clock()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), wait_s)

    @property
    def num_pending_cleanups(self) -> int:
        """Cleanups (cancelled calls, Aborts) still running in the background."""
        return len(self._cleanups)

    async def drain(self) -> None:
        """Waits for outstanding cleanups (Aborts) at shutdown."""
        if self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)

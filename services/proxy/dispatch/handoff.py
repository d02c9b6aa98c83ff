"""E+P+D in the proxy: a job's attempt spans a prefill and a decode instance.

Order (README, "KV hand-off"): the decode instance D is chosen first and
reserves KV blocks for the prompt (``ReserveKV``), so that the prefill
instance P knows where to push; then P runs as a PD does in E+PD (Preallocate,
Encodes pushing to P, Generate, now with the hand-off), prefills, samples the
first token and pushes the KV to D before its stream ends; then D's Generate
takes the reservation over and streams the answer from the first token on.
Nothing reaches the client before D's first message, so a failure of P or of
D up to then moves the job to another pair (a fresh request id), within the
job's one deadline. Any exit but a clean finish aborts the request on both.
"""

from __future__ import annotations

import grpc

from services.common import grpc_utils
from services.common.pb import epd_pb2
from services.proxy.backends.instances import Outcome, PdClient, outcome_of
from services.proxy.dispatch.attempt import Attempt
from services.proxy.dispatch.calls import Calls, note_retry
from services.proxy.dispatch.jobs import Job
from services.proxy.dispatch.pipeline import Pipeline
from services.proxy.errors import internal_error, no_backend
from services.proxy.metrics import ProxyMetrics

_DECODE_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class HandoffAttempt(Attempt):
    """One try of a job on a prefill instance (``pd``) and a decode instance (``decode``)."""

    def __init__(
        self, calls: Calls, job: Job, pd: PdClient, request_id: str, decode: PdClient, cached_tokens: int = 0
    ) -> None:
        super().__init__(calls, job, pd, request_id, cached_tokens)
        self.decode = decode
        self.decode_probe = decode.begin()
        self.decode_outcome = Outcome.NEUTRAL
        self.prefill_call: grpc.aio.UnaryStreamCall | None = None
        self.prefill_status: str | None = None  # P's final status once its part is done (``status``: D's then)
        self.prefill_cached_tokens = 0  # P's prefix-cache hit: D keys pushed K/V for its request alone

    async def start(self, handoff: epd_pb2.KVHandoff | None = None) -> epd_pb2.GenerateResponse:
        job, calls = self.job, self.calls
        # From the call on, the decode instance may hold a reservation, even when this task is
        # cancelled while the call is in flight: any exit but a clean finish aborts it there.
        self.started_rpc = True
        try:
            grant = await self.decode.reserve_kv(
                epd_pb2.ReserveKVRequest(
                    request_id=self.request_id,
                    prompt_token_ids=job.prompt.token_ids,
                    items=job.prompt.mm_items_pb(),
                    lease_ms=calls.lease_ms(job),
                    cache_salt=job.prompt.cache_salt,
                ),
                timeout=calls.remaining(job),
            )
        except grpc.aio.AioRpcError as error:
            self._blame_decode(error)
            raise
        handoff = epd_pb2.KVHandoff(
            address=self.decode.address,
            reservation_id=grant.reservation_id,
            num_cached_blocks=grant.num_cached_blocks,
        )
        try:
            await super().start(handoff)  # P's Preallocate, Encodes and Generate
            while not self.finished:  # P's stream: the first token, then its end once the KV landed
                if await self.next() is None:
                    raise internal_error("The prefill server ended the stream without a result.")
        except grpc.aio.AioRpcError as error:
            if grpc_utils.failed_hop(error) == grpc_utils.KV_PUSH_HOP:
                self._blame_decode(error)
            raise
        self.prefill_call, self.finished, self.prefill_status, self.status = self.call, False, self.status, "CANCELLED"
        return await self._start_decode(grant.reservation_id)

    async def _start_decode(self, reservation_id: str) -> epd_pb2.GenerateResponse:
        job = self.job
        self.streaming = self.decode  # its output tokens are the decode instance's work
        self.call = self.decode.generate(
            job.generate_request(self.request_id, kv_reservation_id=reservation_id),
            timeout=self.calls.remaining(job),
        )
        try:
            first = await self.next()
        except grpc.aio.AioRpcError as error:
            self._blame_decode(error)
            raise
        if first is None:
            raise internal_error("The decode server ended the stream without a result.")
        self.first = first
        self.decode_outcome = Outcome.SUCCESS
        return first

    async def next(self) -> epd_pb2.GenerateResponse | None:
        """The next message; D's usage reports the prompt tokens P found cached (the computing it saved):
        D's own cache never holds pushed K/V for another request, so its count misses them."""
        message = await super().next()
        if message is None or not message.HasField("usage"):
            return message
        if self.prefill_status is None:
            self.prefill_cached_tokens = max(self.prefill_cached_tokens, message.usage.cached_tokens)
        elif message.usage.cached_tokens < self.prefill_cached_tokens:
            message.usage.cached_tokens = self.prefill_cached_tokens
        return message

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if self.prefill_status is not None:  # P's part ended well: the stream that broke is D's
            self._blame_decode(error, retry=False)  # the pipeline notes the retry, if it makes one
        super().fail(error)

    def _blame_decode(self, error: grpc.aio.AioRpcError, *, retry: bool = True) -> None:
        self.decode_outcome = outcome_of(error.code())
        self.pd_is_innocent = True
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.decode.mark_busy(1.0)
        # The decode instance failed the job: the job's next try avoids it.
        self.job.decodes_tried.add(self.decode.address)
        if retry and error.code() in _DECODE_RETRY_CODES:
            note_retry(self.calls.metrics, self.decode, error.code(), self.job.request_id)

    def count(self, metrics: ProxyMetrics) -> None:
        if self.prefill_status is None:  # it ended in P's part (or in the reservation): D never streamed
            super().count(metrics)
            return
        metrics.backend_requests.labels("pd", self.pd.address, self.prefill_status).inc()
        metrics.backend_requests.labels("decode", self.decode.address, self.status).inc()

    async def abort(self) -> None:
        await super().abort()
        await self.decode.abort(self.request_id)

    def stop(self):
        if self.prefill_call is not None:
            self.prefill_call.cancel()
        self.decode.end(self.decode_outcome, probe=self.decode_probe)
        return super().stop()


class HandoffPipeline(Pipeline):
    """The pipeline of an E+P+D cluster: ``backends.pds`` are prefill instances, ``backends.decodes`` decode ones."""

    def new_attempt(self, job: Job, pd: PdClient, request_id: str, cached_tokens: int = 0) -> Attempt:
        tried = job.decodes_tried
        candidates = self.backends.decode_candidates(exclude=tried, prompt=job.route)
        if not candidates:  # every decode instance failed this job once: try them again in rank order
            candidates = self.backends.decode_candidates(prompt=job.route)
        job.route.decision = None  # the decode instance's: only the prefill instance's is counted
        if not candidates:
            raise no_backend("decode")
        return HandoffAttempt(self.calls, job, pd, request_id, candidates[0], cached_tokens)

"""The request flow across PD and encoders (DESIGN §3), independent of HTTP.

Text-only: PD ``Generate`` directly. With images: ``Preallocate`` on PD
(no encoder work before PD has room), then PD ``Generate`` and one
``Encode`` per chosen encoder run concurrently; the encoders push the
embeddings straight to that PD.

Failover happens only before the first token reached the caller and
always with a fresh request id: a PD that answers RESOURCE_EXHAUSTED or
UNAVAILABLE at admission is skipped for the next candidate; an encoder
that is UNAVAILABLE hands its images to the next one in their ranking.

Every exit path (finish, error, cancellation, client gone) cancels the
Generate stream and the Encode calls; any exit but a clean finish also
sends PD ``Abort`` (idempotent), from a task that survives the caller's
cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from services.common import grpc_utils, tensors
from services.common.pb import epd_pb2
from services.proxy.backends import Backends, EncoderClient, PdClient
from services.proxy.errors import ApiError, from_grpc, internal_error
from services.proxy.preprocess import ImageItem, Prompt

log = logging.getLogger(__name__)

_ADMISSION_RETRY_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
MAX_ENCODER_FAILOVERS = 1
"""Extra encoders an image group may try after an UNAVAILABLE one."""


def new_request_id(prefix: str = "chatcmpl") -> str:
    """A fresh, unguessable request id (also the OpenAI response id)."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Trace:
    """Proxy-side measurements of one request (reported as ``usage.epd``)."""

    started: float = field(default_factory=time.monotonic)
    preprocess_ms: float = 0.0
    preallocate_ms: float | None = None
    encode_ms: float | None = None          # wall time of the slowest Encode call
    first_token_ms: float | None = None     # arrival -> first PD message
    num_images_ready: int = 0               # already on PD at Preallocate (no encode)
    num_encoder_cache_hits: int = 0
    num_pd_attempts: int = 0
    pd_address: str | None = None


@dataclass
class Job:
    """One generation request as the pipeline sees it."""

    request_id: str
    prompt: Prompt
    sampling: epd_pb2.SamplingParams
    deadline: float                          # time.monotonic() value
    trace: Trace = field(default_factory=Trace)


class _Attempt:
    """One try of a job on one PD: its Preallocate, Generate stream and Encode tasks."""

    def __init__(self, pipeline: Pipeline, job: Job, pd: PdClient, request_id: str) -> None:
        self.pipeline = pipeline
        self.job = job
        self.pd = pd
        self.request_id = request_id
        self.call: grpc.aio.UnaryStreamCall | None = None
        self.encode_tasks: list[asyncio.Task] = []
        self._pending_encodes: set[asyncio.Task] = set()
        self.first: epd_pb2.GenerateResponse | None = None  # set by start()
        self.finished = False  # PD sent its final message
        self.started_rpc = False
        pd.num_outstanding += 1

    async def start(self) -> epd_pb2.GenerateResponse:
        """Admits the job on this PD and returns its first message."""
        job, pd = self.job, self.pd
        reserved: list[tuple[ImageItem, str]] = []
        self.started_rpc = True
        if job.prompt.images:
            begin = time.monotonic()
            reply = await pd.preallocate(
                epd_pb2.PreallocateRequest(
                    request_id=self.request_id,
                    prompt_token_ids=job.prompt.token_ids,
                    items=job.prompt.mm_items_pb(),
                    lease_ms=self.pipeline.lease_ms(job),
                ),
                timeout=self.pipeline.remaining(job),
            )
            job.trace.preallocate_ms = (time.monotonic() - begin) * 1000
            reserved = self._reserved(reply)
        self.call = pd.generate(
            epd_pb2.GenerateRequest(
                request_id=self.request_id,
                prompt_token_ids=job.prompt.token_ids,
                mm_items=job.prompt.mm_items_pb(),
                sampling=job.sampling,
            ),
            timeout=self.pipeline.remaining(job),
        )
        self.encode_tasks = [
            asyncio.create_task(self.pipeline.encode_group(self, ranked, items))
            for ranked, items in self.pipeline.group_by_encoder(reserved)
        ]
        self._pending_encodes = set(self.encode_tasks)
        self.first = await self.next()
        if self.first is None:
            raise internal_error("The model server ended the stream without a result.")
        return self.first

    def _reserved(self, reply: epd_pb2.PreallocateResponse) -> list[tuple[ImageItem, str]]:
        """Items that need an encoder, with their reservation ids; READY ones are already on PD."""
        images = self.job.prompt.images
        if len(reply.items) != len(images) or any(a.mm_hash != i.mm_hash for a, i in zip(reply.items, images)):
            raise internal_error("The model server's reservation did not match the request.")
        reserved, seen = [], set()
        for alloc, image in zip(reply.items, images):
            if alloc.state == epd_pb2.ItemAllocation.READY:
                self.job.trace.num_images_ready += 1
            elif alloc.state == epd_pb2.ItemAllocation.RESERVED and alloc.reservation_id:
                # The same image twice may share one reservation: push it once.
                if alloc.reservation_id not in seen:
                    seen.add(alloc.reservation_id)
                    reserved.append((image, alloc.reservation_id))
            else:
                raise internal_error("The model server's reservation did not match the request.")
        return reserved

    async def next(self) -> epd_pb2.GenerateResponse | None:
        """The next PD message (None at end of stream); raises the first Encode failure."""
        assert self.call is not None
        read = asyncio.ensure_future(self.call.read())
        try:
            while self._pending_encodes:
                done, _ = await asyncio.wait({read, *self._pending_encodes}, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {read}:
                    self._pending_encodes.discard(task)
                    task.result()  # an Encode failure ends the request: PD would wait forever
                if read in done:
                    break
            message = await read
        finally:
            # Cancelling a pending read cancels the RPC, which is what every
            # early exit from here wants.
            if not read.done():
                read.cancel()
        if message is grpc.aio.EOF:
            return None
        if message.finish_reason != epd_pb2.FINISH_REASON_UNSPECIFIED:
            self.finished = True
        return message

    def stop(self) -> list[asyncio.Task]:
        """Cancels everything in flight; returns the tasks to await (never raises)."""
        if self.call is not None:
            self.call.cancel()
        for task in self.encode_tasks:
            task.cancel()
        self.pd.num_outstanding -= 1
        return self.encode_tasks


class Pipeline:
    """Runs jobs against the backends; one instance per app."""

    def __init__(self, backends: Backends, *, lease_ms: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.backends = backends
        self._lease_ms = lease_ms
        self._clock = clock
        self._cleanups: set[asyncio.Task] = set()  # strong refs: cleanup outlives a cancelled caller

    def remaining(self, job: Job) -> float:
        """Seconds left before the job's deadline; a spent deadline ends the request (504)."""
        left = job.deadline - self._clock()
        if left <= 0:
            raise from_grpc(grpc.StatusCode.DEADLINE_EXCEEDED)
        return left

    def lease_ms(self, job: Job) -> int:
        """The configured lease, never past the deadline; 0 = PD's default (PD caps it by the call deadline)."""
        if not self._lease_ms:
            return 0
        return max(1, min(self._lease_ms, int(self.remaining(job) * 1000)))

    async def generate(self, job: Job) -> AsyncIterator[epd_pb2.GenerateResponse]:
        """Yields PD messages up to and including the one with ``finish_reason``.

        Raises ``ApiError`` (mapped from gRPC status codes) on any failure,
        before or after the first message.
        """
        if job.prompt.images and not self.backends.encoders:
            raise ApiError(503, "No encoder is configured for image requests.", "server_error", "backend_unavailable")
        attempt = await self._admit(job)
        try:
            message = attempt.first
            while message is not None:
                yield message
                if attempt.finished:
                    return
                message = await attempt.next()
            raise internal_error("The model server ended the stream without a result.")
        except grpc.aio.AioRpcError as error:
            raise self._to_api_error(error, attempt.request_id) from None
        finally:
            await self._finish(attempt)

    async def _admit(self, job: Job) -> _Attempt:
        """Starts the job on the best PD, failing over on admission refusals."""
        candidates = self.backends.pd_router.candidates()
        for index, pd in enumerate(candidates):
            request_id = job.request_id if index == 0 else f"{job.request_id}-{index}"
            attempt = _Attempt(self, job, pd, request_id)
            job.trace.num_pd_attempts += 1
            job.trace.pd_address = pd.address
            try:
                await attempt.start()
                job.trace.first_token_ms = (time.monotonic() - job.trace.started) * 1000
                return attempt
            except grpc.aio.AioRpcError as error:
                await self._finish(attempt)
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    pd.mark_down(self.backends.cooldown_s)
                if error.code() in _ADMISSION_RETRY_CODES and index + 1 < len(candidates):
                    log.info("request %s: PD %s refused (%s), trying the next", request_id, pd.address, error.code().name)
                    continue
                raise self._to_api_error(error, request_id) from None
            except BaseException:
                await self._finish(attempt)
                raise
        raise AssertionError("unreachable: the router always returns at least one PD")

    def group_by_encoder(
        self, reserved: list[tuple[ImageItem, str]]
    ) -> list[tuple[list[EncoderClient], list[tuple[ImageItem, str]]]]:
        """One group per first-choice encoder; a group fails over along its first item's ranking."""
        groups: dict[str, tuple[list[EncoderClient], list[tuple[ImageItem, str]]]] = {}
        for image, reservation_id in reserved:
            ranked = self.backends.encoder_router.rank(image.mm_hash)
            groups.setdefault(ranked[0].address, (ranked, []))[1].append((image, reservation_id))
        return list(groups.values())

    async def encode_group(
        self, attempt: _Attempt, ranked: list[EncoderClient], items: list[tuple[ImageItem, str]]
    ) -> None:
        """One Encode call for ``items``; the encoder pushes results to ``attempt.pd``."""
        job = attempt.job
        request = epd_pb2.EncodeRequest(
            request_id=attempt.request_id,
            pd_address=attempt.pd.address,
            items=[
                epd_pb2.EncodeItem(
                    mm_hash=image.mm_hash, reservation_id=reservation_id, pixel_values=tensors.to_pb(image.pixel_values)
                )
                for image, reservation_id in items
            ],
        )
        begin = time.monotonic()
        for index, encoder in enumerate(ranked[: 1 + MAX_ENCODER_FAILOVERS]):
            encoder.num_outstanding += 1
            try:
                reply = await encoder.encode(request, timeout=self.remaining(job))
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    encoder.mark_down(self.backends.cooldown_s)
                    if index + 1 < min(len(ranked), 1 + MAX_ENCODER_FAILOVERS):
                        continue
                raise self._to_api_error(error, attempt.request_id, what="encoder") from None
            finally:
                encoder.num_outstanding -= 1
            elapsed_ms = (time.monotonic() - begin) * 1000
            job.trace.encode_ms = max(job.trace.encode_ms or 0.0, elapsed_ms)
            job.trace.num_encoder_cache_hits += sum(1 for item in reply.items if item.cache_hit)
            return

    def _to_api_error(self, error: grpc.aio.AioRpcError, request_id: str, what: str = "PD") -> ApiError:
        code = error.code()
        # Backend details are ours (no client input), but keep them out of the
        # HTTP body anyway; the log has them for operators.
        log.warning("request %s: %s failed with %s: %.200s", request_id, what, code.name, error.details() or "")
        return from_grpc(code, grpc_utils.retry_after_ms(error) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None)

    async def _finish(self, attempt: _Attempt) -> None:
        """Stops the attempt; Abort on PD unless it finished cleanly. Survives cancellation."""
        tasks = attempt.stop()
        needs_abort = attempt.started_rpc and not attempt.finished

        async def cleanup() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            if needs_abort:
                await attempt.pd.abort(attempt.request_id)

        task = asyncio.create_task(cleanup())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)

    async def drain(self) -> None:
        """Waits for outstanding cleanups (Aborts) at shutdown."""
        if self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)

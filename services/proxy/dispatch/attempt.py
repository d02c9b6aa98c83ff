"""One try of a job on one PD (``Attempt``): its Preallocate, Generate stream and Encode tasks.

The job loop that starts attempts, fails them over and cleans them up is
``Pipeline`` (``pipeline.py``); it hands each attempt the ``Calls``
(``calls.py``: the Encodes, the deadline, the lease), so an attempt never
calls back into it. E+P+D's attempt, which adds a decode instance, is
``handoff.HandoffAttempt``.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common.pb import epd_pb2
from services.proxy.backends.instances import Outcome, PdClient, outcome_of
from services.proxy.dispatch.calls import Calls
from services.proxy.dispatch.jobs import Job
from services.proxy.errors import internal_error
from services.proxy.metrics import ProxyMetrics
from services.proxy.prompt.preprocess import ImageItem


class Attempt:
    """One try of a job on one PD: its Preallocate, Generate stream and Encode tasks."""

    def __init__(self, calls: Calls, job: Job, pd: PdClient, request_id: str, cached_tokens: int = 0) -> None:
        """``cached_tokens``: prompt tokens the routing found in ``pd``'s caches (the rest is work for it)."""
        self.calls = calls
        self.job = job
        self.pd = pd
        self.request_id = request_id
        self.call: grpc.aio.UnaryStreamCall[epd_pb2.GenerateRequest, epd_pb2.GenerateResponse] | None = None
        self.encode_tasks: list[asyncio.Task] = []
        self._pending_encodes: set[asyncio.Task] = set()
        self.first: epd_pb2.GenerateResponse | None = None  # set by start()
        self.finished = False  # PD sent its final message
        self.started_rpc = False
        self.outcome = Outcome.NEUTRAL
        self.status = "CANCELLED"  # for metrics: OK, a gRPC code name, or CANCELLED
        self.probe = pd.begin()  # the breaker's half-open probe: settled at the first message
        self._held: dict[PdClient, int] = {}  # uncached tokens counted on each PD while this attempt runs
        self.streaming = pd  # the PD whose tokens ``next`` reads (E+P+D: the decode instance after the prefill)
        self.hold(pd, len(job.prompt.token_ids) - cached_tokens)
        self.settled = False
        self.pd_is_innocent = False  # set when an error was another instance's doing
        self._in_window = False  # holds a place in the PD's image window (``Calls.enter_window``)

    async def start(self, handoff: epd_pb2.KVHandoff | None = None) -> epd_pb2.GenerateResponse:
        """Admits the job on this PD and returns its first message (``handoff``: PD is E+P+D's prefill
        instance, which pushes the KV there after the first token; ``handoff.py``)."""
        job, pd = self.job, self.pd
        reserved: list[tuple[ImageItem, str]] = []
        self.started_rpc = True
        job.trace.num_images_ready = job.trace.num_encoder_cache_hits = 0  # this attempt's, not a failed one's
        if job.prompt.images:
            await self.calls.enter_window(job, pd.address)
            self._in_window = True
            begin = time.monotonic()
            reply = await pd.preallocate(
                epd_pb2.PreallocateRequest(
                    request_id=self.request_id,
                    prompt_token_ids=job.prompt.token_ids,
                    items=job.prompt.mm_items_pb(),
                    lease_ms=self.calls.lease_ms(job),
                    cache_salt=job.prompt.cache_salt,
                ),
                timeout=self.calls.remaining(job),
            )
            job.trace.preallocate_ms = (time.monotonic() - begin) * 1000
            reserved = self._reserved(reply)
            if not reserved:  # every image already on PD: nothing to encode, nothing to take turns with
                self._leave_window()
        self.call = pd.generate(
            job.generate_request(self.request_id, kv_handoff=handoff), timeout=self.calls.remaining(job)
        )
        self.encode_tasks = [
            asyncio.create_task(self.calls.encode_image(job, self.request_id, pd.address, image, reservation_id))
            for image, reservation_id in reserved
        ]
        self._pending_encodes = set(self.encode_tasks)
        self.first = await self.next()
        self._leave_window()  # prefilled: the next image request may start
        if self.first is None:
            raise internal_error("The model server ended the stream without a result.")
        self.outcome = Outcome.SUCCESS
        pd.settle(Outcome.SUCCESS, probe=self.probe)
        self.settled = True
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
        """The next PD message (None at end of stream); before the first one, raises the first Encode failure.

        PD's first message comes after it prefilled the whole prompt: every image was on PD by then (from
        this request's push, or from the embedding another request's push brought). An Encode still running
        after it is not needed: its failure (PD answering a push that came too late to matter) is not this
        request's, and the call is cancelled at the attempt's end like any other.
        """
        assert self.call is not None
        read = asyncio.ensure_future(self.call.read())
        try:
            while self._pending_encodes and self.first is None:
                done, _ = await asyncio.wait({read, *self._pending_encodes}, return_when=asyncio.FIRST_COMPLETED)
                if read in done:
                    # PD answered first. If it failed, that is the cause; an Encode
                    # failing at the same moment (pushing to that PD) is its echo.
                    break
                for task in done:
                    self._pending_encodes.discard(task)
                    task.result()  # an Encode failure ends the request: PD would wait forever
            message = await read
        finally:
            # Cancelling a pending read cancels the RPC, which is what every
            # early exit from here wants.
            if not read.done():
                read.cancel()
        if not isinstance(message, epd_pb2.GenerateResponse):  # grpc.aio.EOF (read() is typed object | T)
            return None
        self.hold(self.streaming, len(message.token_ids))
        if message.finish_reason != epd_pb2.FINISH_REASON_UNSPECIFIED:
            self.finished = True
            self.status = "OK"
        return message

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """Records a PD error for the breaker and metrics. An error another instance caused
        (``pd_is_innocent``: E+P+D's decode instance) is not held against this PD's breaker: a dead decode
        instance would otherwise open the breakers of the prefill instances that tried it, and with them
        every route."""
        if not self.pd_is_innocent:
            self.outcome = outcome_of(error.code())
        self.status = error.code().name

    def count(self, metrics: ProxyMetrics) -> None:
        """Counts this attempt's outcome per instance (``epd_proxy_backend_requests_total``)."""
        metrics.backend_requests.labels("pd", self.pd.address, self.status).inc()

    async def abort(self) -> None:
        """Ends the request on every instance holding something of it (idempotent there)."""
        await self.pd.abort(self.request_id)

    def stop(self) -> list[asyncio.Task]:
        """Cancels everything in flight; returns the tasks to await (never raises)."""
        if self.call is not None:
            self.call.cancel()
        for task in self.encode_tasks:
            task.cancel()
        self._leave_window()
        self.pd.end(self.outcome, probe=self.probe, settled=self.settled)
        for pd, num_tokens in self._held.items():
            pd.release_tokens(num_tokens, finished=self.finished)
        self._held.clear()
        return self.encode_tasks

    def _leave_window(self) -> None:
        if self._in_window:
            self._in_window = False
            self.calls.windows.leave(self.pd.address)

    def hold(self, pd: PdClient, num_tokens: int) -> None:
        """Counts ``num_tokens`` of work of this attempt on ``pd`` (its load, for the cache-aware policy) until
        the attempt stops."""
        pd.hold_tokens(num_tokens)
        self._held[pd] = self._held.get(pd, 0) + num_tokens

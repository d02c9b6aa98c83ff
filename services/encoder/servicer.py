"""The ``epd.v1.Encoder`` servicer: validate, delegate to the batcher and pusher, report.

Errors are raised as ``EncoderError`` and turned into status codes by
``errors.ErrorMappingInterceptor``. Cancellation (client gone, deadline)
cancels every item task; the batcher and pusher release their share in
``finally`` blocks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc

from services.common import grpc_utils
from services.common.encode_items import ProcessFile, has_video
from services.common.logs import log_request
from services.common.models.vision_io import PixelLayout
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.common.video_files import DecodeBudget, DecodeStopped
from services.encoder.batcher import Batcher
from services.encoder.cache import EmbeddingCache
from services.encoder.convert import (
    EncodeItemWork,
    EncodeWork,
    ItemOutcome,
    check_pd_address,
    encode_response,
    encoder_load,
    parse_encode_request,
)
from services.encoder.errors import DeadlineExceeded, EncoderError, PdNotAllowed
from services.encoder.metrics import EncoderMetrics
from services.encoder.pd_allow import PdAllowList
from services.encoder.pusher import EmbeddingPusher
from services.encoder.video_decodes import VideoDecodes

log = logging.getLogger(__name__)


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The exception to report for a failed item group: an ``EncoderError`` when there is one."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    for exc in leaves:
        if isinstance(exc, EncoderError):
            return exc
    return leaves[0]


class EncoderServicer(epd_pb2_grpc.EncoderServicer):
    """Thin adapter between the wire and the batcher/pusher."""

    def __init__(
        self,
        batcher: Batcher,
        pusher: EmbeddingPusher,
        cache: EmbeddingCache,
        metrics: EncoderMetrics | None = None,
        layout: PixelLayout = PixelLayout(),
        process_file: ProcessFile | None = None,
        pd_allow: PdAllowList | None = None,
        accept_pixel_values: bool = False,
        video_decodes: VideoDecodes | None = None,
    ) -> None:
        self.video_decodes = video_decodes or VideoDecodes(threads=1, max_queued=8)
        self._pd_allow = pd_allow or PdAllowList()  # loopback only unless configured
        self._accept_pixel_values = accept_pixel_values  # EncoderConfig.accept_pixel_values
        self._layout = layout  # what the vision module takes: checked before anything is queued
        self._process_file = process_file  # image files -> pixels
        self._batcher = batcher
        self._pusher = pusher
        self._cache = cache
        self._metrics = metrics or EncoderMetrics()

    async def Encode(self, request: epd_pb2.EncodeRequest, context: grpc.aio.ServicerContext) -> epd_pb2.EncodeResponse:
        """Embeds each item (cache, single flight, micro-batch) and pushes it to PD; items run concurrently."""
        start = time.perf_counter()
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        status = "UNKNOWN"
        request_id = grpc_utils.request_id_of(context)  # until the request body is validated
        outcomes: list[ItemOutcome] = []
        budget = DecodeBudget(deadline)
        try:
            # Before any other work: the address decides where this encoder, and its token, go.
            if not await self._pd_allow.allows(check_pd_address(request.pd_address)):
                raise PdNotAllowed("pd_address is not a PD this encoder may push to (--pd-allow)")
            work = await self._parse(request, budget)
            request_id = work.request_id
            outcomes = await self._encode_all(work, deadline, remaining)
            status = "OK"
            return encode_response(outcomes)
        except EncoderError as err:
            status = err.code.name
            raise
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except Exception:
            status = "INTERNAL"  # the interceptor logs it and answers INTERNAL
            raise
        finally:
            budget.cancel()  # a video decode still running for this call stops at its next frame
            duration = time.perf_counter() - start
            self._metrics.on_request(status, duration)
            log_request(
                log,
                "encode",
                request_id=request_id,
                status=status,
                items=len(request.items),
                cache_hits=sum(outcome.cache_hit for outcome in outcomes),
                duration_ms=duration * 1000.0,
            )

    async def _parse(self, request: epd_pb2.EncodeRequest, budget: DecodeBudget) -> EncodeWork:
        """The validated request; off the event loop (checking pixels, decoding and processing files is CPU work),
        videos on their own bounded threads. ``DeadlineExceeded`` when a video's decoding outlasts the deadline."""
        parse = functools.partial(
            parse_encode_request, request, self._layout, self._process_file, self._accept_pixel_values, budget
        )
        try:
            if has_video(request):
                return await self.video_decodes.run(parse)
            return await asyncio.to_thread(parse)
        except DecodeStopped:
            raise DeadlineExceeded("deadline exceeded while decoding a video") from None

    async def _encode_all(self, work: EncodeWork, deadline: float | None, remaining: float | None) -> list[ItemOutcome]:
        try:
            # TaskGroup: the first failing item cancels its siblings, and
            # cancelling this call cancels them all.
            async with asyncio.timeout(remaining), asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._encode_item(work, item, deadline)) for item in work.items]
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded") from None
        except BaseExceptionGroup as failed:
            raise _first_error(failed) from None
        return [task.result() for task in tasks]

    async def _encode_item(self, work: EncodeWork, item: EncodeItemWork, deadline: float | None) -> ItemOutcome:
        result = await self._batcher.encode(item.mm_hash, item.pixel_values, deadline, item.grid)
        push_start = time.perf_counter()
        await self._pusher.push(
            work.pd_address,
            request_id=work.request_id,
            reservation_id=item.reservation_id,
            mm_hash=item.mm_hash,
            embedding=result.embedding,
            deadline=deadline,
        )
        push_s = time.perf_counter() - push_start
        self._metrics.on_item(result.cache_hit, result.encode_s, push_s, result.embedding.nbytes)
        return ItemOutcome(item.mm_hash, result.cache_hit, result.encode_s, push_s)

    async def GetLoad(self, request: epd_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> epd_pb2.EncoderLoad:
        """Pending images, cache bytes and outbound push bytes, for routing."""
        return encoder_load(self._batcher.num_pending, self._cache.bytes, self._pusher.outbound_bytes)

"""Colocated mode (``epd pd --encoder local``): PD runs the vision tower inside its own step loop.

This is the baseline every benchmark compares against: a monolithic engine.
PD loads the vision half of the checkpoint too and serves ``epd.v1.Encoder``
on its own port, so the proxy needs no special case (its encoder address is
the PD's address) and requests follow the same Preallocate -> Generate +
Encode path as in disaggregated mode.

An Encode call queues its images and asks the engine thread to encode
everything queued. That command runs between two engine steps, so the vision
forward blocks the batch exactly as it does in a monolithic engine, and its
results fill the reservations through the engine's own fill path (no gRPC
push, no copy). Images queued by concurrent calls share one forward (up to
``MAX_BATCH_IMAGES``; those with equal ``LoadedVision.batch_key``: any grids
for dynamic-resolution towers); an image already READY on PD, or queued
twice, is computed once.

Decoding streams wait through that forward too. The step budget counts
engine-thread time between steps (``StepBudget.before_step``), so the step
right after an encode prefills only what the latency target still allows:
the baseline gets the same adaptive budget as disaggregated PDs, nothing here
needs to report the forward.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2

from services.common import grpc_utils, openmp, tensors
from services.common.encode_items import ProcessFile, has_video, item_pixels
from services.common.logs import log_request
from services.common.models.loaded_vision import LoadedVision
from services.common.models.vision_io import Grid, PixelLayout
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.common.video_decodes import RETRY_AFTER_MS, DecodesFull, VideoDecodes
from services.common.video_files import NO_BUDGET, DecodeBudget, DecodeStopped
from services.pd.bridge import EngineBridge
from services.pd.config import PdConfig
from services.pd.convert import check_cache_salt, check_request_id
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.servicer import abort_with

log = logging.getLogger(__name__)

ENCODER_SERVICE = "epd.v1.Encoder"
"""Health service name that means "ready to encode"."""

MAX_BATCH_IMAGES = 8
"""Most images in one colocated vision forward (the encoder service's default batch)."""


@dataclass(eq=False)
class ColocatedItem:
    """One image of an Encode call; the engine thread writes its outcome."""

    request_id: str
    reservation_id: str
    mm_hash: str
    pixel_values: torch.Tensor  # [3, H, W], or patches [t*h*w, D] with a grid
    deadline: float  # time.monotonic() seconds (inf = none)
    grid: Grid | None = None  # patch grid of a dynamic-resolution image
    cancelled: bool = False  # the call is gone: skip at dequeue
    error: EngineError | None = None
    cache_hit: bool = False  # already READY on PD: filled without a forward
    encode_s: float = 0.0


class ColocatedEncoder:
    """Queue of images waiting for the engine thread, and the code that encodes them there."""

    def __init__(self, engine: EngineBridge, vision: LoadedVision, max_batch_images: int = MAX_BATCH_IMAGES) -> None:
        self._engine = engine
        self._vision = vision
        self._max_batch = max_batch_images
        self._lock = threading.Lock()  # guards the queue and the counter (loop and engine thread)
        self._queue: deque[ColocatedItem] = deque()
        self._num_images_encoded = 0

    @property
    def vision(self) -> LoadedVision:
        return self._vision

    @property
    def num_pending(self) -> int:
        """Images queued and not yet taken by the engine thread."""
        with self._lock:
            return len(self._queue)

    @property
    def num_images_encoded(self) -> int:
        """Images that went through a successful vision forward since start (cumulative)."""
        with self._lock:
            return self._num_images_encoded

    async def warm_up(self) -> None:
        """Blank-image forwards on the engine thread; raises if the shape is not what the LM expects."""
        await self._engine.call(self._vision.warm_up, self._max_batch)

    async def encode(self, items: list[ColocatedItem]) -> list[ColocatedItem]:
        """Encodes ``items`` on the engine thread and fills their reservations; raises the first error."""
        with self._lock:
            self._queue.extend(items)
        try:
            # Our items are queued before our command, so they are done (by
            # this command or an earlier one) when it returns.
            await self._engine.call(self._encode_queued)
        finally:
            with self._lock:
                for item in items:
                    item.cancelled = True  # a no-op once done; skips them if we were cancelled
                    if item in self._queue:
                        self._queue.remove(item)
        for item in items:
            if item.error is not None:
                raise item.error
        return items

    # ------------------------------------------------------------ engine thread

    def _encode_queued(self) -> None:
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
        now = time.monotonic()
        by_hash: dict[str, list[ColocatedItem]] = {}
        for item in items:
            if item.cancelled:
                continue
            if now >= item.deadline:
                item.error = EngineError(ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded before encoding")
                continue
            try:
                # Another reservation already brought this image: filled without a forward.
                item.cache_hit = self._engine.core.fill_cached(item.request_id, item.reservation_id, item.mm_hash)
            except EngineError as error:
                item.error = error
                continue
            if not item.cache_hit:
                by_hash.setdefault(item.mm_hash, []).append(item)
        by_shape: dict[tuple, list[list[ColocatedItem]]] = {}
        for same_image in by_hash.values():
            key = self._vision.batch_key(same_image[0].pixel_values, same_image[0].grid)
            by_shape.setdefault(key, []).append(same_image)
        for groups in by_shape.values():
            for start in range(0, len(groups), self._max_batch):
                self._forward_and_fill(groups[start : start + self._max_batch])

    def _forward_and_fill(self, groups: list[list[ColocatedItem]]) -> None:
        """One forward over the first item of each group (one group per image); fills every item."""
        vision = self._vision
        start = time.perf_counter()
        try:
            out = vision.encode([(group[0].pixel_values, group[0].grid) for group in groups])  # per image
        except Exception:
            log.exception("colocated vision forward failed for %d images", len(groups))
            for group in groups:
                for item in group:
                    item.error = EngineError(ErrorKind.INTERNAL, "vision encoder failed")
            return
        elapsed = time.perf_counter() - start
        with self._lock:
            self._num_images_encoded += len(groups)
        for group, row in zip(groups, out):
            # A stored row must not pin the whole batch's output.
            row = row.clone() if len(groups) > 1 else row
            for item in group:
                item.encode_s = elapsed
                try:
                    # The engine's own push path (validation, cast, store), run in place.
                    self._engine.core.fill(item.request_id, item.reservation_id, item.mm_hash, row)
                except EngineError as error:
                    item.error = error


def _check_id(value: str, what: str) -> str:
    if not value or len(value) > tensors.MAX_ID_CHARS or not value.isprintable():
        raise EngineError(ErrorKind.INVALID_ARGUMENT, f"{what} must be 1..{tensors.MAX_ID_CHARS} printable characters")
    return value


def parse_encode_request(
    request: epd_pb2.EncodeRequest,
    deadline: float,
    layout: PixelLayout = PixelLayout(),
    process_file: ProcessFile | None = None,
    accept_pixel_values: bool = True,
    budget: DecodeBudget = NO_BUDGET,
) -> list[ColocatedItem]:
    """Validates an EncodeRequest into items; ``pd_address`` is not used (the reservations are ours).

    ``process_file`` turns image files into pixels (``encode_items``); call this off the event loop.
    ``budget``: when a video's decoding must stop (``DecodeStopped``).
    """
    request_id = check_request_id(request.request_id)
    cache_salt = check_cache_salt(request.cache_salt)
    if not request.items:
        raise EngineError(ErrorKind.INVALID_ARGUMENT, "items must not be empty")
    items = []
    for index, item in enumerate(request.items):
        reservation_id = _check_id(item.reservation_id, f"item {index}: reservation_id")
        mm_hash = _check_id(item.mm_hash, f"item {index}: mm_hash")
        try:
            pixels, grid = item_pixels(item, index, layout, process_file, cache_salt, accept_pixel_values, budget)
        except ValueError as error:
            raise EngineError(ErrorKind.INVALID_ARGUMENT, str(error)) from None
        except DecodeStopped:
            raise EngineError(ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded while decoding a video") from None
        items.append(ColocatedItem(request_id, reservation_id, mm_hash, pixels, deadline, grid))
    return items


VIDEO_THREADS = 1
"""Videos a colocated PD decodes at once (the encoder's ``--video-threads`` default)."""
VIDEO_QUEUE = 8
"""Encode calls with a video waiting for a decode thread; beyond it RESOURCE_EXHAUSTED (the encoder's default)."""


class ColocatedEncoderServicer(epd_pb2_grpc.EncoderServicer):
    """``epd.v1.Encoder`` served by PD itself; reservations held by another PD are NOT_FOUND."""

    def __init__(self, encoder: ColocatedEncoder, accept_pixel_values: bool = False) -> None:
        self._encoder = encoder
        self._accept_pixel_values = accept_pixel_values  # PdConfig.accept_pixel_values
        # Videos decode on threads of their own, as at the encoder (its defaults: one thread, eight waiting).
        self.video_decodes = VideoDecodes(threads=VIDEO_THREADS, max_queued=VIDEO_QUEUE)

    async def Encode(self, request: epd_pb2.EncodeRequest, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        remaining = context.time_remaining()
        deadline = float("inf") if remaining is None else time.monotonic() + remaining
        status = "CANCELLED"
        budget = DecodeBudget(None if remaining is None else deadline)
        try:
            vision = self._encoder.vision
            # Off the event loop: checking pixels, and decoding and processing image files, is CPU work.
            parse = functools.partial(
                parse_encode_request,
                request,
                deadline,
                vision.layout,
                vision.process_file,
                self._accept_pixel_values,
                budget,
            )
            items = await (self._decode_videos(parse) if has_video(request) else asyncio.to_thread(parse))
            done = await self._encoder.encode(items)
            status = "OK"
        except EngineError as error:
            status = error.kind.name
            await abort_with(context, error)
        finally:
            budget.cancel()  # a video decode still running for this call stops at its next frame
            log_request(
                log,
                "encode",
                request_id=grpc_utils.request_id_of(context),
                status=status,
                items=len(request.items),
                colocated=True,
                duration_ms=(time.perf_counter() - start) * 1000,
            )
        return epd_pb2.EncodeResponse(
            items=[
                epd_pb2.EncodeItemResult(mm_hash=item.mm_hash, cache_hit=item.cache_hit, encode_ms=item.encode_s * 1000)
                for item in done
            ]
        )

    async def _decode_videos(self, parse: Callable[[], list[ColocatedItem]]) -> list[ColocatedItem]:
        """``parse`` on the video decode threads; RESOURCE_EXHAUSTED when they and their queue are taken."""
        try:
            return await self.video_decodes.run(parse)
        except DecodesFull as error:
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, str(error), RETRY_AFTER_MS / 1000) from None

    async def GetLoad(self, request: epd_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> Any:
        # PD's embedding cache is the only cache; nothing is pushed over the network.
        return epd_pb2.EncoderLoad(num_pending=self._encoder.num_pending)


class Colocated:
    """The colocated encoder of one PD: what ``start_pd`` registers, warms up and marks ready."""

    def __init__(self, encoder: ColocatedEncoder, accept_pixel_values: bool = False) -> None:
        self.encoder = encoder
        self._servicer = ColocatedEncoderServicer(encoder, accept_pixel_values)

    @classmethod
    async def load(cls, config: PdConfig, engine: EngineBridge) -> Colocated:
        """Loads the vision half off the event loop; serve it with ``register`` + ``become_ready``."""
        vision = await asyncio.to_thread(
            openmp.on_own_thread,
            LoadedVision.load,
            config.model,
            config.device,
            config.dtype,
            config.video_limits(),
            config.linear_backend,
        )
        return cls(ColocatedEncoder(engine, vision), config.accept_pixel_values)

    def register(self, server: grpc.aio.Server) -> None:
        epd_pb2_grpc.add_EncoderServicer_to_server(self._servicer, server)

    async def become_ready(self, server: grpc_utils.GrpcServer, warm_up: bool = True) -> None:
        """Warm-up forward on the engine thread (unless disabled), then report ``epd.v1.Encoder`` SERVING."""
        if warm_up:
            await self.encoder.warm_up()
        await self.set_ready(server, True)

    @staticmethod
    async def set_ready(server: grpc_utils.GrpcServer, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        await server.health.set(ENCODER_SERVICE, status)

"""Encoder process assembly: load the vision half, start the gRPC server, warm up, report ready.

Lifecycle: ``start_encoder`` loads weights (off the event loop), starts the
server with health NOT_SERVING, runs one blank-image forward, starts the
batcher thread and only then reports SERVING. ``EncoderServer.stop``
reports NOT_SERVING, lets calls drain for ``grace`` seconds, then stops the
worker and closes the PD channels.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import NamedTuple

import grpc

from services.common import grpc_utils
from services.common.metrics_http import MetricsHttpServer
from services.common.models.loaded_vision import LoadedVision
from services.common.pb import epd_pb2_grpc
from services.common.watchdog import Probe, set_alive, watch_engine
from services.encoder.batcher import Batcher
from services.encoder.cache import EmbeddingCache
from services.encoder.config import EncoderConfig
from services.encoder.errors import ErrorMappingInterceptor
from services.encoder.metrics import EncoderMetrics, PrometheusEncoderMetrics
from services.encoder.pd_allow import PdAllowList, PdAllowSpec
from services.encoder.pusher import EmbeddingPusher
from services.encoder.servicer import EncoderServicer
from services.encoder.video_decodes import VideoDecodes

log = logging.getLogger(__name__)

SERVICE_NAME = "epd.v1.Encoder"
"""Health service name that means "ready"."""


class EncoderStats(NamedTuple):
    """Resource counters; all zero but the cache when the encoder is idle (leak checks).

    ``num_images_encoded`` is the exception: a cumulative count of images that
    went through the vision forward (how tests see caching and single flight).
    """

    num_pending: int  # images queued or being encoded
    cache_bytes: int
    num_cached: int
    outbound_bytes: int  # bytes of pushes in flight
    num_images_encoded: int = 0
    num_video_decodes: int = 0  # video Encode calls decoding or waiting for a decode thread


def load_vision(config: EncoderConfig) -> LoadedVision:
    """Loads only the vision tower + projector of ``config.model`` (blocking; run off the loop)."""
    return LoadedVision.load(config.model, config.device, config.dtype, config.video_limits(), config.linear_backend)


def _log_pd_allow(spec: PdAllowSpec) -> None:
    """One start-up line saying where pushes may go; a warning when anywhere."""
    if spec.any:
        log.warning("--pd-allow '*': Encode calls may name any PD address, and pushes carry the internal token there")
    else:
        log.info("pushes go only to PDs on the allow-list: %s", spec.describe())


class EncoderServer:
    """A running encoder: gRPC server, batcher thread, cache and PD pusher."""

    def __init__(
        self,
        config: EncoderConfig,
        vision: LoadedVision,
        grpc_server: grpc_utils.GrpcServer,
        batcher: Batcher,
        pusher: EmbeddingPusher,
        cache: EmbeddingCache,
        video_decodes: VideoDecodes | None = None,
    ) -> None:
        self.config = config
        self._video_decodes = video_decodes or VideoDecodes(config.video_threads, config.video_queue)
        self.vision = vision
        self._grpc = grpc_server
        self._batcher = batcher
        self._pusher = pusher
        self._cache = cache
        self.metrics_http: MetricsHttpServer | None = None  # ``GET /metrics``, when enabled
        self._watchdog: asyncio.Task | None = None  # readiness and liveness follow the batcher (watchdog.py)

    @classmethod
    async def create(
        cls, config: EncoderConfig, vision: LoadedVision, metrics: EncoderMetrics | None = None
    ) -> EncoderServer:
        """Starts serving with health NOT_SERVING; call ``become_ready`` next."""
        metrics = metrics or EncoderMetrics()
        cache = EmbeddingCache(config.cache_bytes)
        batcher = Batcher(
            vision.module,
            cache,
            device=vision.device,
            dtype=vision.dtype,
            max_batch_images=config.max_batch_images,
            max_wait_ms=config.max_wait_ms,
            max_pending=config.max_pending,
            metrics=metrics,
        )
        pusher = EmbeddingPusher(
            chunk_bytes=config.push_chunk_bytes,
            max_outbound_bytes=config.max_outbound_bytes,
            default_timeout_s=config.push_timeout_s,
            max_attempts=config.push_attempts,
            connect_timeout_s=config.push_connect_timeout_s,
            faults=config.faults,
            channel_factory=functools.partial(grpc_utils.aio_channel, security=config.security),
        )
        if config.faults.enabled:
            log.warning("FAULT INJECTION ENABLED (test only): %s", config.faults.describe())
        video_decodes = VideoDecodes(config.video_threads, config.video_queue)
        servicer = EncoderServicer(
            batcher,
            pusher,
            cache,
            metrics,
            layout=vision.layout,
            process_file=vision.process_file,
            pd_allow=PdAllowList(config.pd_allow),
            accept_pixel_values=config.accept_pixel_values,
            video_decodes=video_decodes,
        )
        _log_pd_allow(config.pd_allow)

        def register(server: grpc.aio.Server) -> None:
            epd_pb2_grpc.add_EncoderServicer_to_server(servicer, server)

        grpc_server = await grpc_utils.start_server(
            config.host,
            config.port,
            SERVICE_NAME,
            register,
            interceptors=[ErrorMappingInterceptor()],
            security=config.security,
            max_receive_bytes=config.max_message_bytes,
        )
        return cls(config, vision, grpc_server, batcher, pusher, cache, video_decodes)

    @property
    def port(self) -> int:
        """The bound gRPC port."""
        return self._grpc.port

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def become_ready(self) -> None:
        """Warm-up forward (if configured), start the batcher thread, report SERVING.

        Encode calls that arrive earlier wait in the queue for the worker.
        """
        if self.config.warmup:
            await asyncio.to_thread(self.vision.warm_up, self.config.max_batch_images)
        self._batcher.start()
        await self._grpc.set_ready(True)
        self._watchdog = asyncio.create_task(
            watch_engine(
                self._batcher,
                [
                    Probe("ready", self._grpc.set_ready, self.config.stall_timeout_s),
                    Probe("alive", functools.partial(set_alive, self._grpc), self.config.liveness_timeout_s),
                ],
            )
        )

    def stats(self) -> EncoderStats:
        return EncoderStats(
            num_pending=self._batcher.num_pending,
            cache_bytes=self._cache.bytes,
            num_cached=len(self._cache),
            outbound_bytes=self._pusher.outbound_bytes,
            num_images_encoded=self._batcher.num_images_encoded,
            num_video_decodes=self._video_decodes.num_admitted,
        )

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, drain calls for ``grace`` seconds (default ``config.grace_s``), stop the worker."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self._grpc.stop(self.config.grace_s if grace is None else grace)
        self._video_decodes.shutdown()
        await asyncio.to_thread(self._batcher.stop)
        await self._pusher.close()
        if self.metrics_http is not None:  # last: a scrape can still see the drain
            await self.metrics_http.stop()


async def start_encoder(
    config: EncoderConfig, *, vision: LoadedVision | None = None, metrics: EncoderMetrics | None = None
) -> EncoderServer:
    """Loads the vision half (unless ``vision`` is given), serves, warms up and reports ready.

    With ``config.metrics_port >= 0`` and no ``metrics`` sink of the caller's,
    ``epd_encoder_*`` metrics are served on that port.
    """
    if vision is None:
        vision = await asyncio.to_thread(load_vision, config)
    exporter = PrometheusEncoderMetrics() if metrics is None and config.metrics_port >= 0 else None
    server = await EncoderServer.create(config, vision, metrics or exporter)
    try:
        if exporter is not None:
            host = config.metrics_host or config.host
            server.metrics_http = await exporter.serve(
                host, config.metrics_port, server.stats, token=config.security.metrics_token
            )
        await server.become_ready()
    except BaseException:
        await server.stop(0)
        raise
    log.info("encoder ready on %s (device=%s dtype=%s)", server.address, vision.device, vision.dtype)
    return server

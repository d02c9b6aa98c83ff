"""The proxy app's lifespan: loads the processor, connects the backends and builds ``ProxyState``.

Also tears it all down again (scrape port, pipeline drain, owned backends,
media fetcher, work pools) when the app stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI

from services.common import grpc_utils
from services.proxy.backends.cache_index import CacheIndex
from services.proxy.backends.discovery import Pool, Resolver, system_resolver
from services.proxy.backends.instances import CircuitBreaker, EncoderClient, Instance, PdClient
from services.proxy.backends.monitor import Monitor
from services.proxy.backends.pools import Backends
from services.proxy.backends.routing import make_encoder_policy, make_pd_policy
from services.proxy.config import MIB, ProxyConfig
from services.proxy.dispatch.handoff import HandoffPipeline
from services.proxy.dispatch.pipeline import Pipeline, StallLimits
from services.proxy.metrics import ProxyMetrics
from services.proxy.prompt.media import MediaFetcher, MediaPolicy
from services.proxy.prompt.preprocess import Preprocessor
from services.proxy.prompt.workers import WorkPool
from services.proxy.state import ProxyState
from services.proxy.web.fairness import REFUSAL_REASONS, ClientLimiter, FairnessLimits
from services.proxy.web.middleware import InternalsGuard

log = logging.getLogger(__name__)


def default_served_name(model: str, model_id: str) -> str:
    """A built-in preset is served under its preset name ("tiny"); anything else under its model id."""
    from services.common.models.presets import PRESETS

    name = model or "tiny"
    return name if name in PRESETS else model_id


async def _load_preprocessor(config: ProxyConfig) -> tuple[Any, Preprocessor, int]:
    """The model's adapter, the ``Preprocessor`` built on it and the max model length served."""
    from services.common.models.cache import ensure_model_in_child
    from services.common.models.supported import load_processing

    # The torch-free half of the adapter; a missing built-in model is built in a child process.
    adapter = await asyncio.to_thread(lambda: load_processing(str(ensure_model_in_child(config.model))))
    processor = await asyncio.to_thread(adapter.load_processor)
    max_model_len = min(config.max_model_len or adapter.max_model_len, adapter.max_model_len)
    preprocessor = Preprocessor(
        adapter,
        processor,
        max_images=config.max_images_per_request,
        max_image_pixels=config.max_image_pixels,
        max_request_pixels=config.max_request_pixels,
        max_model_len=max_model_len,
        faults=config.faults,
        video_limits=config.video_limits(),
    )
    return adapter, preprocessor, max_model_len


def connect_backends(
    config: ProxyConfig, *, resolver: Resolver = system_resolver, metrics: ProxyMetrics | None = None
) -> Backends:
    """Pools for ``config``'s targets with health watching, load polling and, for the cache-aware policy, the
    PDs' cache events (nothing connects yet)."""
    index = None
    if config.pd_policy == "cache-aware":
        index = CacheIndex(
            config.pd_cache_index_mb * MIB, on_lag=metrics.cache_event_lag.observe if metrics is not None else None
        )
    monitor = Monitor(
        load_interval_s=config.load_poll_s,
        cache_index=index,
        on_resync=(lambda reason: metrics.cache_event_resyncs.labels(reason).inc()) if metrics is not None else None,
    )

    def breaker() -> CircuitBreaker:
        return CircuitBreaker(config.breaker_failures, config.breaker_open_s, max(config.breaker_open_s, 30.0))

    async def removed(instance: Instance) -> None:
        await monitor.unwatch(instance)
        await instance.channel.close()

    def pool(kind: str, targets, client_cls) -> Pool:
        return Pool(
            kind,
            targets,
            lambda address: client_cls(
                address,
                grpc_utils.aio_channel(address, config.security),
                breaker=breaker(),
                launch_key=config.security.peer_launch_key(address),
            ),
            resolver=resolver,
            on_added=monitor.watch,
            on_removed=removed,
        )

    return Backends(
        pool("pd", config.pd_addresses, PdClient),
        pool("encoder", config.encoder_addresses, EncoderClient),
        pd_policy=make_pd_policy(config.pd_policy, cache_index=index, cache_weight=config.pd_cache_weight),
        encoder_policy=make_encoder_policy(config.encoder_policy, saturation=config.encoder_saturation),
        monitor=monitor,
        dns_refresh_s=config.dns_refresh_s,
        decode_pool=pool("decode", config.decode_addresses, PdClient) if config.decode_addresses else None,
    )


def _new_pipeline(config: ProxyConfig, pool: Backends, metrics: ProxyMetrics) -> Pipeline:
    """The E+PD pipeline, or the E+P+D one when decode instances are configured."""
    return (HandoffPipeline if config.decode_addresses else Pipeline)(
        pool,
        lease_ms=config.lease_ms,
        pd_attempts=config.pd_attempts,
        encoder_attempts=config.encoder_attempts,
        image_window=config.pd_image_window,
        metrics=metrics,
        stall_limits=StallLimits(config.first_token_timeout_s, config.inter_token_timeout_s, config.encode_timeout_s),
    )


def _client_limiter(config: ProxyConfig, metrics: ProxyMetrics) -> ClientLimiter:
    """The per-client limits, counting each refusal by its reason."""
    refusals = metrics.client_limit_refusals
    for reason in REFUSAL_REASONS:
        refusals.labels(reason)  # exported at 0 from the start
    return ClientLimiter(
        FairnessLimits(config.max_requests_per_client, config.max_tokens_per_client_per_minute),
        on_refusal=lambda reason: refusals.labels(reason).inc(),
    )


def _media_fetcher(config: ProxyConfig) -> MediaFetcher | None:
    """The remote-media fetcher ``--allowed-media-domains`` asks for (None: remote media refused)."""
    if not config.allowed_media_domains:
        return None
    return MediaFetcher(MediaPolicy(config.allowed_media_domains, config.media_timeout_s, config.max_media_bytes))


def proxy_lifespan(config: ProxyConfig, backends: Backends | None, fetcher: MediaFetcher | None, metrics: ProxyMetrics):
    """The app's lifespan: ``ProxyState`` on ``app.state.proxy`` while the app runs, all of it closed after."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        adapter, preprocessor, max_model_len = await _load_preprocessor(config)
        if config.faults.enabled:
            log.warning("FAULT INJECTION ENABLED (test only): %s", config.faults.describe())
        owned = backends is None
        pool = backends or connect_backends(config, metrics=metrics)
        await pool.start()
        metrics.watch_instances(lambda: [*pool.pds, *pool.encoders, *pool.decodes])
        metrics.watch_cache_index(pool.monitor.cache_index if pool.monitor is not None else None)
        pipeline = _new_pipeline(config, pool, metrics)
        media = fetcher if fetcher is not None else _media_fetcher(config)
        text_pool = WorkPool("text", config.preprocess_threads, config.text_queue)
        image_pool = WorkPool("image", config.image_threads, config.image_queue)
        video_pool = WorkPool("video", config.video_threads, config.video_queue)
        app.state.proxy = ProxyState(
            config=config,
            adapter=adapter,
            preprocessor=preprocessor,
            backends=pool,
            pipeline=pipeline,
            text_pool=text_pool,
            image_pool=image_pool,
            video_pool=video_pool,
            metrics=metrics,
            fetcher=media,
            served_model_name=config.served_model_name or default_served_name(config.model, adapter.model_id),
            max_model_len=max_model_len,
            created=int(time.time()),
            guard=InternalsGuard(config.api_key, require_token=config.security.metrics_auth),
            limiter=_client_limiter(config, metrics),
        )
        scrape_port = None
        if config.metrics_port >= 0:
            host = config.metrics_host or config.host
            scrape_port = await metrics.serve(host, config.metrics_port, token=config.security.metrics_token)
        app.state.metrics_http = scrape_port
        log.info(
            "proxy serving %s: PDs %s, encoders %s (policies %s / %s)",
            app.state.proxy.served_model_name,
            [p.address for p in pool.pds],
            [e.address for e in pool.encoders],
            config.pd_policy,
            config.encoder_policy,
        )
        try:
            yield
        finally:
            if scrape_port is not None:
                await scrape_port.stop()
            await pipeline.drain()
            if owned:
                await pool.close()
            if media is not None and fetcher is None:
                await media.aclose()
            text_pool.shutdown()
            image_pool.shutdown()
            video_pool.shutdown()

    return lifespan

"""The ``/metrics`` endpoints of real encoder and PD servers: start, stop, a busy or stopped engine.

A metrics port that is taken fails start-up cleanly (nothing left running);
stopping a server closes its endpoint; a scrape that the PD engine cannot
answer in time serves the last values with ``epd_pd_engine_responsive 0``.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
from cluster_support import encoder_config, pd_config
from prometheus_client.parser import text_string_to_metric_families

from services.encoder.server import start_encoder
from services.pd import step_calibration
from services.pd.config import PdConfig
from services.pd.metrics import PdMetrics
from services.pd.server import start_pd


def _values(text: str | bytes) -> dict[str, float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _threads(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name == name and t.is_alive())


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


async def _refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


async def test_pd_with_a_taken_metrics_port_fails_to_start_and_leaves_nothing_running(tiny_model_dir, taken_port):
    engines_before = _threads("pd-engine")
    with pytest.raises(OSError):
        await start_pd(pd_config(str(tiny_model_dir), port=0, metrics_port=taken_port, warmup=False))
    assert _threads("pd-engine") == engines_before


async def test_encoder_with_a_taken_metrics_port_fails_to_start_and_leaves_nothing_running(tiny_model_dir, taken_port):
    workers_before = _threads("encoder-batcher")
    with pytest.raises(OSError):
        await start_encoder(encoder_config(str(tiny_model_dir), port=0, metrics_port=taken_port, warmup=False))
    assert _threads("encoder-batcher") == workers_before


async def test_encoder_stop_closes_its_metrics_endpoint(tiny_model_dir):
    encoder = await start_encoder(encoder_config(str(tiny_model_dir), port=0, metrics_port=0, grace_s=0))
    port = encoder.metrics_http.port
    try:
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert reply.status_code == 200 and _values(reply.text)["epd_encoder_queue_depth"] == 0
    finally:
        await encoder.stop(0)
    assert await _refused(port)


async def test_pd_scrape_serves_the_last_values_when_the_engine_does_not_answer(tiny_model_dir):
    pd = await start_pd(pd_config(str(tiny_model_dir), port=0, metrics_port=0, grace_s=0))
    port = pd.metrics_http.port
    try:
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert reply.status_code == 200
        served = _values(reply.text)
        # The warm-up: one token, then the step-time calibration's requests.
        calibration = step_calibration
        warm_up_tokens = (
            1
            + calibration.NUM_PASSES
            * (len(calibration.PROMPT_LENGTHS) + calibration.BATCH_SIZE)
            * calibration.NUM_OUTPUT_TOKENS
        )
        assert served["epd_pd_engine_responsive"] == 1 and served["epd_pd_generation_tokens_total"] == warm_up_tokens
        paths = {
            s.labels["path"]: s.value
            for f in text_string_to_metric_families(reply.text)
            for s in f.samples
            if s.name == "epd_pd_captured_paths"
        }
        assert paths == {"static_decode": 0, "flex_kernel": 0, "cuda_graphs": 0}  # CPU: packed decode steps

        metrics = PdMetrics(pd.engine, snapshot_timeout_s=0.05)
        await metrics.refresh()
        busy = asyncio.ensure_future(pd.engine.call(time.sleep, 2.0))  # the engine thread is stuck meanwhile
        stale = _values(await metrics.render())
        assert stale["epd_pd_engine_responsive"] == 0
        assert stale["epd_pd_kv_blocks_total"] == served["epd_pd_kv_blocks_total"]  # the last values, still served
        await busy
        assert _values(await metrics.render())["epd_pd_engine_responsive"] == 1
    finally:
        await pd.stop(0)
    assert await _refused(port)
    gone = _values(await metrics.render())  # the engine has stopped: no answer, last values
    assert gone["epd_pd_engine_responsive"] == 0 and gone["epd_pd_kv_blocks_total"] > 0


async def test_pd_scrape_before_any_snapshot_reports_only_responsiveness(tiny_model_dir):
    pd = await start_pd(pd_config(str(tiny_model_dir), port=0, warmup=False, grace_s=0))
    await pd.stop(0)
    assert pd.metrics_http is None  # metrics off: no endpoint was started
    assert _values(await PdMetrics(pd.engine).render()) == {"epd_pd_engine_responsive": 0.0}


async def test_pd_metrics_behind_the_internal_token(tiny_model_dir):
    from services.common.security import InternalSecurity

    token = "pd-metrics-token-0123456789"
    config = PdConfig(
        model=str(tiny_model_dir),
        port=0,
        metrics_port=0,
        warmup=False,
        security=InternalSecurity(token=token, metrics_auth=True),
    )
    pd = await start_pd(config)
    try:
        url = f"http://127.0.0.1:{pd.metrics_http.port}/metrics"
        async with httpx.AsyncClient() as client:
            assert (await client.get(url)).status_code == 401
            reply = await client.get(url, headers={"Authorization": f"Bearer {token}"})
        assert reply.status_code == 200 and "epd_pd_engine_responsive" in _values(reply.text)
    finally:
        await pd.stop(0)

"""The pieces behind the ``/metrics`` endpoints, without a model.

The HTTP endpoint (every answer it can give), the encoder's exporter fed
events by hand, the proxy's inter-token timer and PD's step counters with
a fake clock and hand-made step outputs, and the flags: config validation,
CLI defaults, and the ports ``epd up`` hands out.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics_http import MAX_HEAD_BYTES, MetricsHttpServer
from services.encoder import main as encoder_main
from services.encoder.config import EncoderConfig
from services.encoder.metrics import PrometheusEncoderMetrics
from services.launcher import command as up
from services.launcher import ports as up_ports
from services.pd import main as pd_main
from services.pd.config import PdConfig
from services.pd.engine.outputs import ModelRunnerOutput, SampledToken, ScheduledChunk, SchedulerOutput
from services.pd.engine.step_stats import STEP_SECONDS_BUCKETS, StepStats
from services.proxy.config import ProxyConfig
from services.proxy.metrics import TokenGaps

# ----------------------------------------------------------------- HTTP endpoint


async def _render_ok() -> bytes:
    return b"# TYPE epd_test gauge\nepd_test 1.0\n"


async def _ask(port: int, raw: bytes) -> tuple[int, bytes]:
    """Sends ``raw`` and reads the whole answer; returns (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


@pytest.fixture
async def endpoint():
    server = await MetricsHttpServer.start("127.0.0.1", 0, _render_ok, head_timeout_s=0.2)
    yield server
    await server.stop()


async def test_get_metrics_answers_the_rendered_text(endpoint):
    status, body = await _ask(endpoint.port, b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n")
    assert status == 200 and body == await _render_ok()


async def test_other_paths_methods_and_malformed_requests_are_refused(endpoint):
    assert (await _ask(endpoint.port, b"GET /secret HTTP/1.1\r\n\r\n"))[0] == 404
    assert (await _ask(endpoint.port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 405
    assert (await _ask(endpoint.port, b"nonsense\r\n\r\n"))[0] == 400
    assert (await _ask(endpoint.port, b"GET /metrics SMTP\r\n\r\n"))[0] == 400
    status, body = await _ask(endpoint.port, b"GET /" + b"a" * MAX_HEAD_BYTES + b" HTTP/1.1\r\n\r\n")
    assert status == 400 and b"aaaa" not in body  # nothing of the request is echoed


async def test_a_request_head_that_never_ends_times_out(endpoint):
    assert (await _ask(endpoint.port, b"GET /metrics HTTP/1.1\r\n"))[0] == 400


async def test_a_failing_render_answers_500_and_the_endpoint_keeps_serving():
    calls = []

    async def render_fails_once() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("collector broke")
        return await _render_ok()

    server = await MetricsHttpServer.start("127.0.0.1", 0, render_fails_once)
    try:
        assert (await _ask(server.port, b"GET /metrics HTTP/1.1\r\n\r\n"))[0] == 500
        assert (await _ask(server.port, b"GET /metrics HTTP/1.1\r\n\r\n"))[0] == 200
    finally:
        await server.stop()


async def test_stop_ends_idle_connections_and_frees_the_port():
    server = await MetricsHttpServer.start("127.0.0.1", 0, _render_ok)
    port = server.port
    _, idle = await asyncio.open_connection("127.0.0.1", port)  # connected, never sends
    await asyncio.sleep(0.05)
    await asyncio.wait_for(server.stop(), 10)
    idle.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_a_token_protected_endpoint_needs_the_bearer_token():
    token = "metrics-token-0123456789"
    server = await MetricsHttpServer.start("127.0.0.1", 0, _render_ok, token=token)
    try:
        status, body = await _ask(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert status == 401 and b"epd_test" not in body
        wrong = b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer metrics-token-0123456780\r\n\r\n"
        assert (await _ask(server.port, wrong))[0] == 401
        right = f"GET /metrics HTTP/1.1\r\nHost: a\r\nauthorization:  Bearer {token}\r\n\r\n".encode()
        status, body = await _ask(server.port, right)
        assert status == 200 and body == await _render_ok()
    finally:
        await server.stop()


async def test_a_port_in_use_raises():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            await MetricsHttpServer.start("127.0.0.1", taken.getsockname()[1], _render_ok)


# ------------------------------------------------------------- encoder exporter


def _values(text: bytes) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_encoder_exporter_counts_every_event():
    metrics = PrometheusEncoderMetrics()
    metrics.watch(lambda: SimpleNamespace(cache_bytes=4096, num_cached=2, num_pending=3, outbound_bytes=512))
    metrics.on_batch(4, 0.02, True)
    metrics.on_batch(2, 0.5, False)
    metrics.on_dropped(1, "deadline")
    metrics.on_dropped(2, "shutdown")
    metrics.on_rejected()
    metrics.on_item(True, 0.0, 0.003, 1000)
    metrics.on_item(False, 0.02, 0.004, 1000)
    metrics.on_request("OK", 0.03)
    metrics.on_request("RESOURCE_EXHAUSTED", 0.001)
    v = _values(metrics.render())
    assert v[("epd_encoder_images_total", ())] == 4 and v[("epd_encoder_failed_images_total", ())] == 2
    assert v[("epd_encoder_batch_size_count", ())] == 1 and v[("epd_encoder_batch_size_sum", ())] == 4
    assert v[("epd_encoder_encode_seconds_count", ())] == 1  # a failed forward is not an encode time
    assert v[("epd_encoder_dropped_images_total", (("reason", "deadline"),))] == 1
    assert v[("epd_encoder_dropped_images_total", (("reason", "shutdown"),))] == 2
    assert v[("epd_encoder_dropped_images_total", (("reason", "cancelled"),))] == 0
    assert v[("epd_encoder_rejected_images_total", ())] == 1
    assert v[("epd_encoder_cache_hits_total", ())] == v[("epd_encoder_cache_misses_total", ())] == 1
    assert v[("epd_encoder_push_seconds_count", ())] == 2 and v[("epd_encoder_push_bytes_total", ())] == 2000
    assert v[("epd_encoder_requests_total", (("status", "RESOURCE_EXHAUSTED"),))] == 1
    assert v[("epd_encoder_queue_depth", ())] == 3 and v[("epd_encoder_cache_bytes", ())] == 4096
    assert v[("epd_encoder_cache_entries", ())] == 2 and v[("epd_encoder_outbound_bytes", ())] == 512


def test_two_encoder_exporters_do_not_share_values():
    first, second = PrometheusEncoderMetrics(), PrometheusEncoderMetrics()
    first.on_rejected()
    assert _values(second.render())[("epd_encoder_rejected_images_total", ())] == 0


# -------------------------------------------------------------- proxy: token gaps


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _histogram() -> Histogram:
    return Histogram("gap_seconds", "test", registry=CollectorRegistry(), buckets=(0.05, 0.2, 1.0))


def _observed(histogram: Histogram) -> tuple[float, float]:
    samples = {s.name: s.value for s in histogram.collect()[0].samples}
    return samples["gap_seconds_count"], samples["gap_seconds_sum"]


def test_token_gaps_split_a_message_gap_over_its_tokens():
    histogram, clock = _histogram(), _Clock()
    gaps = TokenGaps(histogram, clock)
    gaps.add(1)  # the first token starts the clock
    clock.now = 0.1
    gaps.add(1)
    clock.now = 0.1
    gaps.add(0)  # a message without tokens changes nothing
    clock.now = 0.5
    gaps.add(2)  # 0.4 s for two tokens: two samples of 0.2
    count, total = _observed(histogram)
    assert count == 3 and total == pytest.approx(0.5)


def test_disabled_token_gaps_observe_nothing():
    gaps = TokenGaps(None, _Clock())
    for _ in range(3):
        gaps.add(1)  # must not fail without a histogram


# ---------------------------------------------------------------- PD step stats


def _chunk(request_id: str, start: int, num: int, outputs: int) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=request_id, token_ids=[1] * num, start_pos=start, block_ids=[0], num_output_tokens=outputs
    )


def test_step_stats_count_prompts_once_and_every_sampled_token():
    stats = StepStats()
    # Step 1: request a prefills 8 of 12 prompt tokens (no sample); b's 5-token prompt ends and samples.
    stats.record(
        SchedulerOutput(chunks=[_chunk("a", 0, 8, 0), _chunk("b", 0, 5, 0)]),
        ModelRunnerOutput(sampled={"b": SampledToken(7)}),
        0.002,
    )
    # Step 2: a's prompt ends at 12 (4 of them came from the prefix cache earlier); b decodes.
    stats.record(
        SchedulerOutput(chunks=[_chunk("a", 8, 4, 0), _chunk("b", 5, 1, 1)]),
        ModelRunnerOutput(sampled={"a": SampledToken(3), "b": SampledToken(4)}),
        0.3,
    )
    snap = stats.snapshot()
    assert snap.num_steps == 2 and snap.num_prompt_tokens == 5 + 12 and snap.num_generation_tokens == 3
    assert snap.sum_seconds == pytest.approx(0.302)
    bounds = list(STEP_SECONDS_BUCKETS)
    assert snap.bucket_counts[bounds.index(0.001)] == 0
    assert snap.bucket_counts[bounds.index(0.0025)] == 1
    assert snap.bucket_counts[bounds.index(0.25)] == 1 and snap.bucket_counts[bounds.index(0.5)] == 2
    assert snap.bucket_counts[-1] == 2  # +Inf


def test_a_step_exactly_on_a_bound_lands_in_that_bucket():
    stats = StepStats()
    stats.record(SchedulerOutput(chunks=[]), ModelRunnerOutput(), STEP_SECONDS_BUCKETS[0])
    assert stats.snapshot().bucket_counts[0] == 1  # le = less than or equal


# --------------------------------------------------------------------- flags


def _parse(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_metrics_flags_reach_the_configs():
    encoder = encoder_main.config_from_args(_parse(encoder_main.add_arguments, []))
    pd = pd_main.config_from_args(_parse(pd_main.add_arguments, []))
    assert (encoder.metrics_port, encoder.metrics_host) == (9101, "")
    assert (pd.metrics_port, pd.metrics_host) == (9201, "")
    argv = ["--metrics-port", "0", "--metrics-host", "0.0.0.0"]
    encoder = encoder_main.config_from_args(_parse(encoder_main.add_arguments, argv))
    pd = pd_main.config_from_args(_parse(pd_main.add_arguments, argv))
    assert (encoder.metrics_port, encoder.metrics_host) == (pd.metrics_port, pd.metrics_host) == (0, "0.0.0.0")


def test_metrics_endpoints_are_off_for_servers_built_in_code():
    assert EncoderConfig().metrics_port == PdConfig(model="").metrics_port == -1


@pytest.mark.parametrize("port", [-2, 65536])
def test_an_invalid_metrics_port_is_refused(port):
    with pytest.raises(ValueError, match="metrics_port"):
        EncoderConfig(metrics_port=port)
    with pytest.raises(ValueError, match="metrics_port"):
        PdConfig(model="", metrics_port=port)
    with pytest.raises(ValueError, match="metrics_port"):
        ProxyConfig(metrics_port=port)


def _spawned(monkeypatch, argv: list[str]) -> dict[str, list[str]]:
    specs = up.service_specs(_parse(up.add_arguments, argv))
    return {spec.name: list(spec.argv) for spec in specs}


def _metrics_port(argv: list[str]) -> str:
    return argv[argv.index("--metrics-port") + 1]


def test_up_gives_each_server_its_own_metrics_port(monkeypatch):
    spawned = _spawned(monkeypatch, ["--encoders", "2", "--pds", "2"])
    ports = {name: _metrics_port(argv) for name, argv in spawned.items()}
    assert ports == {"encoder-0": "9101", "encoder-1": "9102", "pd-0": "9201", "pd-1": "9202", "proxy": "9099"}
    proxy = spawned["proxy"]
    assert proxy[proxy.index("--metrics-host") + 1] == "127.0.0.1"
    spawned = _spawned(monkeypatch, ["--encoder-metrics-base-port", "-1", "--pd-metrics-base-port", "7000"])
    assert _metrics_port(spawned["encoder-0"]) == "-1" and _metrics_port(spawned["pd-0"]) == "7000"


@pytest.mark.parametrize(
    "argv",
    [
        ["--encoders", "11"],  # encoder gRPC 21051..21061 meets PD 21061
        ["--encoder-metrics-base-port", "9201"],  # encoder and PD metrics on one port
        ["--pds", "2", "--pd-metrics-base-port", "8000"],  # PD metrics on the proxy's port
        ["--launcher-metrics-port", "9101"],  # the launcher's metrics on encoder 0's
        ["--proxy-metrics-port", "9300"],  # the proxy's scrape port on the launcher's metrics
    ],
)
def test_up_refuses_ports_that_collide(argv, capsys):
    assert up.run(_parse(up.add_arguments, argv)) == 2
    assert "same port" in capsys.readouterr().err


def test_up_ports_do_not_collide_when_metrics_are_off():
    args = _parse(
        up.add_arguments,
        [
            "--encoders",
            "150",
            "--encoder-metrics-base-port",
            "-1",
            "--pd-base-port",
            "60000",
            "--launcher-metrics-port",
            "-1",
            "--proxy-metrics-port",
            "-1",
        ],
    )
    ports = up_ports.listening_ports(args)
    assert len(ports) == len(set(ports)) == 1 + 150 + 1 + 1  # proxy, encoders, PD, PD metrics

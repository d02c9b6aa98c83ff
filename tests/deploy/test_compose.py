"""deploy/docker-compose.yml: it validates, its wiring is consistent, and its commands really work.

The last test runs each compose service's own command, environment and
health check as local processes (no Docker here), changing only what one host
needs: service DNS names -> 127.0.0.1, container ports -> free ports,
/models -> a temporary directory, ``--host 0.0.0.0`` -> 127.0.0.1.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from deploy_support import (
    COMPOSE_FILE,
    DEPLOY,
    GPU_COMPOSE_FILE,
    READY_SERVICE,
    duration_s,
    flag,
    grace_s,
    load_compose,
    parse_epd_args,
    with_defaults,
)

SERVERS = ("pd", "encoder", "proxy")
MONITORING = ("prometheus", "grafana")

PLANNED_METRICS = frozenset(
    {
        "epd_proxy_requests_total",
        "epd_proxy_time_to_first_token_seconds",
        "epd_proxy_inter_token_latency_seconds",
        "epd_proxy_request_duration_seconds",
        "epd_proxy_requests_in_flight",
        "epd_encoder_images_total",
        "epd_encoder_cache_hits_total",
        "epd_encoder_cache_misses_total",
        "epd_encoder_cache_bytes",
        "epd_encoder_batch_size",
        "epd_encoder_queue_depth",
        "epd_encoder_encode_seconds",
        "epd_encoder_push_seconds",
        "epd_encoder_push_bytes_total",
        "epd_encoder_dropped_images_total",
        "epd_encoder_rejected_images_total",
        "epd_pd_running_requests",
        "epd_pd_waiting_requests",
        "epd_pd_kv_blocks_used",
        "epd_pd_kv_blocks_total",
        "epd_pd_prefix_cache_hit_tokens_total",
        "epd_pd_embedding_cache_tokens",
        "epd_pd_reservations_expired_total",
        "epd_pd_step_seconds",
        "epd_pd_prompt_tokens_total",
        "epd_pd_generation_tokens_total",
        "epd_pd_step_phase_seconds_total",
        "epd_pd_preemptions_total",
        "epd_pd_engine_responsive",
        "epd_pd_step_budget_tokens",
        "epd_pd_itl_target_seconds",
        "epd_pd_step_time_prediction_ratio",
    }
)
"""The metric names the dashboard is drawn for (histograms without _bucket/_sum/_count)."""


@pytest.fixture(scope="module")
def services() -> dict:
    return load_compose()["services"]


def _docker_compose(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose)")
    return subprocess.run([exe, *args, "config"], capture_output=True, text=True, timeout=60)


def test_docker_compose_config_validates():
    result = _docker_compose("-f", str(COMPOSE_FILE))
    assert result.returncode == 0, result.stderr


def test_docker_compose_config_validates_with_gpu_override_and_monitoring():
    result = _docker_compose("-f", str(COMPOSE_FILE), "-f", str(GPU_COMPOSE_FILE), "--profile", "monitoring")
    assert result.returncode == 0, result.stderr
    assert "nvidia" in result.stdout


def test_server_commands_parse_with_the_real_cli(services):
    for name in SERVERS:
        args = parse_epd_args([str(token) for token in services[name]["command"]])
        assert args.host == "0.0.0.0", f"{name} must listen on the compose network"


def test_only_the_proxy_publishes_a_port(services):
    for name, service in services.items():
        if name in MONITORING:  # opt-in profile, loopback only
            assert service["profiles"] == ["monitoring"]
            assert all(with_defaults(p).startswith("127.0.0.1:") for p in service.get("ports", []))
        elif name == "proxy":
            assert [with_defaults(p) for p in service["ports"]] == [f"8000:{flag(service['command'], '--port')}"]
        else:
            assert "ports" not in service, name


def test_encoder_can_be_scaled(services):
    encoder = services["encoder"]
    assert "container_name" not in encoder and "ports" not in encoder
    proxy_command = services["proxy"]["command"]
    # The proxy names the service, not a replica: DNS returns every replica.
    assert flag(proxy_command, "--encoder") == f"encoder:{flag(encoder['command'], '--port')}"
    assert flag(proxy_command, "--pd") == f"pd:{flag(services['pd']['command'], '--port')}"


def test_start_order_and_health_checks(services):
    one_shot = {"condition": "service_completed_successfully"}
    assert services["pd"]["depends_on"] == {"model": one_shot}
    assert services["encoder"]["depends_on"] == {"model": one_shot}
    assert services["proxy"]["depends_on"] == {
        "pd": {"condition": "service_healthy"},
        "encoder": {"condition": "service_healthy"},
    }
    for name in ("pd", "encoder"):
        command, test = services[name]["command"], services[name]["healthcheck"]["test"]
        assert test == [
            "CMD",
            "epd",
            "health",
            "--address",
            f"127.0.0.1:{flag(command, '--port')}",
            "--service",
            READY_SERVICE[name],
        ]
    port = flag(services["proxy"]["command"], "--port")
    assert services["proxy"]["healthcheck"]["test"] == [
        "CMD",
        "epd",
        "health",
        "--http",
        f"http://127.0.0.1:{port}/health",
    ]


def test_stop_grace_period_outlasts_each_servers_drain(services):
    for name in SERVERS:
        service = services[name]
        assert duration_s(service["stop_grace_period"]) > grace_s(service["command"]), name
        healthcheck = service["healthcheck"]
        assert duration_s(healthcheck["timeout"]) > 2.0  # `epd health --timeout` default


def test_prometheus_scrapes_every_metrics_port(services):
    import yaml

    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {
        (name, sd["port"]) for job in config["scrape_configs"] for sd in job["dns_sd_configs"] for name in sd["names"]
    }
    assert targets == {
        ("proxy", int(flag(services["proxy"]["command"], "--port"))),
        ("encoder", int(flag(services["encoder"]["command"], "--metrics-port"))),
        ("pd", int(flag(services["pd"]["command"], "--metrics-port"))),
    }


def test_internal_security_is_on_for_every_server(services):
    secrets = load_compose()["secrets"]
    assert set(secrets) == {"epd_internal_token"} and "file" in secrets["epd_internal_token"]
    for name in SERVERS:
        service = services[name]
        assert service["secrets"] == ["epd_internal_token"], name
        assert service["environment"]["EPD_INTERNAL_TOKEN_FILE"] == "/run/secrets/epd_internal_token"
        assert service["environment"]["EPD_METRICS_REQUIRE_TOKEN"] == "1"
    # The token file itself never goes into the repository.
    assert "deploy/internal-token" in (DEPLOY.parent / ".gitignore").read_text().split()


def test_prometheus_scrapes_with_the_internal_token(services):
    import yaml

    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        assert job["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/epd_internal_token"}
    assert services["prometheus"]["secrets"] == ["epd_internal_token"]


def test_grafana_dashboard_draws_the_planned_metrics():
    import re

    dashboard = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"\bepd_[a-z0-9_]+", target["expr"]):
                used.add(re.sub(r"_(bucket|sum|count)$", "", name))
    assert used == PLANNED_METRICS
    from services.encoder.metrics import METRICS as ENCODER
    from services.pd.metrics import METRICS as PD
    from services.proxy.metrics import METRICS as PROXY

    assert used <= {doc.name for doc in (*PROXY, *ENCODER, *PD)}, "the dashboard draws a metric nobody exports"

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
import yaml
from deploy_support import (
    COMPOSE_FILE,
    DEPLOY,
    EPD_COMPOSE_FILE,
    EPD_SERVICES,
    GPU_COMPOSE_FILE,
    READY_SERVICE,
    dockerfile_instructions,
    duration_s,
    flag,
    grace_s,
    hardening_gaps_compose,
    image_model_build,
    load_compose,
    parse_epd_args,
    restart_blockers,
    with_defaults,
)

from services.common.ports import DEFAULT_ENCODER_PORT, DEFAULT_PD_PORT, LINUX_EPHEMERAL_PORTS

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
        "epd_pd_kv_push_bytes_total",
        "epd_pd_kv_push_seconds_total",
        "epd_pd_kv_pushes_total",
        "epd_pd_kv_reservations",
        "epd_pd_kv_reservations_expired_total",
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


def test_only_the_proxy_publishes_a_port_on_loopback_by_default(services):
    for name, service in services.items():
        if name in MONITORING:  # opt-in profile, loopback only
            assert service["profiles"] == ["monitoring"]
            assert all(with_defaults(p).startswith("127.0.0.1:") for p in service.get("ports", []))
        elif name == "proxy":
            port = flag(service["command"], "--port")
            assert [with_defaults(p) for p in service["ports"]] == [f"127.0.0.1:8000:{port}"]
            # EPD_PROXY_BIND opens it to other interfaces, EPD_PROXY_PORT moves it.
            assert service["ports"] == [f"${{EPD_PROXY_BIND:-127.0.0.1}}:${{EPD_PROXY_PORT:-8000}}:{port}"]
        else:
            assert "ports" not in service, name


def test_encoder_can_be_scaled(services):
    encoder = services["encoder"]
    assert "container_name" not in encoder and "ports" not in encoder
    proxy_command = services["proxy"]["command"]
    # The proxy names the service, not a replica: DNS returns every replica.
    assert flag(proxy_command, "--encoder") == f"encoder:{flag(encoder['command'], '--port')}"
    assert flag(proxy_command, "--pd") == f"pd:{flag(services['pd']['command'], '--port')}"


def _grpc_health_test(command: list, kind: str) -> list[str]:
    """The healthcheck a gRPC server's service should carry: `epd health` on its own port, its readiness service."""
    return [
        "CMD",
        "epd",
        "health",
        "--address",
        f"127.0.0.1:{flag(command, '--port')}",
        "--service",
        READY_SERVICE[kind],
    ]


def test_start_order_and_health_checks(services):
    # PD and encoders start at once; the proxy waits until both are healthy.
    assert "depends_on" not in services["pd"] and "depends_on" not in services["encoder"]
    assert services["proxy"]["depends_on"] == {
        "pd": {"condition": "service_healthy"},
        "encoder": {"condition": "service_healthy"},
    }
    for name in ("pd", "encoder"):
        assert services[name]["healthcheck"]["test"] == _grpc_health_test(services[name]["command"], name)
    port = flag(services["proxy"]["command"], "--port")
    assert services["proxy"]["healthcheck"]["test"] == [
        "CMD",
        "epd",
        "health",
        "--http",
        f"http://127.0.0.1:{port}/health",
    ]


def test_every_service_restarts_after_a_crash(services):
    assert restart_blockers(services) == []


def test_the_merged_stacks_restart_after_a_crash():
    """The same on what the engine runs: both files merged, every profile on, as ``docker-compose config`` prints."""
    import yaml

    for files in ([COMPOSE_FILE], [COMPOSE_FILE, GPU_COMPOSE_FILE]):
        args = [arg for path in files for arg in ("-f", str(path))]
        result = _docker_compose(*args, "--profile", "monitoring")
        assert result.returncode == 0, result.stderr
        merged = yaml.safe_load(result.stdout)["services"]
        assert set(merged) == set(SERVERS) | set(MONITORING)
        assert restart_blockers(merged) == [], files


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # What the stack did before: a one-shot step every server waited for.
        (
            lambda s: s.update(
                model={"command": ["make-model"], "restart": "no"},
                pd={**s["pd"], "depends_on": {"model": {"condition": "service_completed_successfully"}}},
            ),
            [
                "model does not restart after a crash",
                "pd depends on model, which does not restart",
                "pd waits for model to complete",
            ],
        ),
        (
            lambda s: s["encoder"].pop("restart"),
            ["encoder does not restart after a crash", "proxy depends on encoder, which does not restart"],
        ),
        (
            lambda s: s["pd"].update(restart="on-failure"),
            ["pd does not restart after a crash", "proxy depends on pd, which does not restart"],
        ),
        (lambda s: s["proxy"].update(depends_on=["pd"]), []),
    ],
)
def test_restart_blockers_are_found(services, change, expected):
    import copy

    changed = copy.deepcopy(services)
    change(changed)
    assert restart_blockers(changed) == expected


def test_the_served_model_is_the_one_built_into_the_image(services):
    """No start-up step builds it: a restarted container needs nothing but its image."""
    _, model_dir = image_model_build()
    assert ("ENV", f"EPD_MODEL={model_dir}") in dockerfile_instructions()
    for name in SERVERS:
        assert with_defaults(services[name]["environment"]["EPD_MODEL"]) == model_dir
        assert "volumes" not in services[name], "nothing to keep: no volume, so none left behind"


def test_no_anonymous_volumes(services):
    """Every mount is a named volume of this file or a bind of a file here, and each image VOLUME is covered.

    A VOLUME declared by an image and not mounted becomes a new anonymous
    volume for every container on every ``up``, left behind by ``down``.
    """
    named = set(load_compose()["volumes"])
    assert not [rest for kind, rest in dockerfile_instructions() if kind == "VOLUME"], "the EPD image declares a VOLUME"
    image_volumes = {"prometheus": {"/prometheus"}, "grafana": {"/var/lib/grafana"}}  # from their images' Dockerfiles
    for name, service in services.items():
        targets = set()
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            assert source in named or source.startswith("./"), f"{name}: {volume} is neither named nor a bind"
            targets.add(target)
        assert image_volumes.get(name, set()) <= targets, f"{name}: its image's VOLUME would be anonymous"


def test_the_documented_token_command_makes_a_file_the_container_user_can_read(tmp_path):
    """Written under umask 077 it would be 0600 and unreadable by uid 10001; the command sets its own umask."""
    header = COMPOSE_FILE.read_text().split("x-epd-service:")[0]
    (command,) = [
        line.lstrip("# ").split("   #")[0] for line in header.splitlines() if "> deploy/internal-token" in line
    ]
    (tmp_path / "deploy").mkdir()
    subprocess.run(["/bin/sh", "-c", f"umask 077; {command}"], cwd=tmp_path, check=True, timeout=30)
    token = tmp_path / "deploy" / "internal-token"
    assert token.stat().st_mode & 0o777 == 0o644
    assert len(token.read_text()) >= 40 and "\n" not in token.read_text()


def test_build_arguments_are_the_dockerfiles(services):
    """Compose passes only arguments the Dockerfile declares; the GPU override builds from a CUDA base with the same ones."""
    import yaml

    declared = {rest.split("=")[0] for kind, rest in dockerfile_instructions() if kind == "ARG"}
    for name in SERVERS:
        build = services[name]["build"]
        assert build["dockerfile"] == "deploy/Dockerfile" and set(build["args"]) <= declared
    cpu_args = services["pd"]["build"]["args"]
    assert {"BASE_IMAGE", "TORCH_EXTRA_INDEX_URL", "TORCH_FIND_LINKS"} <= set(cpu_args)
    gpu = yaml.safe_load(GPU_COMPOSE_FILE.read_text())["services"]
    for name in ("pd", "encoder"):
        args = gpu[name]["build"]["args"]
        assert set(args) == set(cpu_args)
        assert with_defaults(args["BASE_IMAGE"]).startswith("nvidia/cuda:")
        assert "/whl/cu" in with_defaults(args["TORCH_EXTRA_INDEX_URL"])
        assert with_defaults(gpu[name]["image"]) != with_defaults(services[name]["image"])


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
        ("proxy", int(flag(services["proxy"]["command"], "--metrics-port"))),
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


def test_grafana_kv_handoff_panels_split_by_role():
    """Every PD exports both sides of the hand-off (``role``: prefill sends, decode receives), so a sum
    over instances without ``by (role)`` would add the bytes sent to the bytes received."""
    import re

    from services.pd.metrics import METRICS as PD

    labels = {doc.name: doc.labels for doc in PD}
    dashboard = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    kv = [expr for expr in exprs if "epd_pd_kv_push" in expr or "epd_pd_kv_reservations" in expr]
    assert len(kv) == 4
    for expr in kv:
        assert all("role" in labels[name] for name in re.findall(r"\bepd_pd_kv_[a-z_]+", expr)), expr
        aggregations = re.findall(r"\b(sum|min|max|avg)\b( by \(([^)]*)\))?", expr)
        assert aggregations and all(by == "role" for _, _, by in aggregations), expr


def test_default_grpc_ports_are_outside_the_ephemeral_range(services):
    """Security review: the compose stack's gRPC ports lie outside Linux's ephemeral range."""
    grpc_ports = [
        int(flag([str(token) for token in services[name]["command"]], "--port")) for name in ("pd", "encoder")
    ]
    assert grpc_ports == [DEFAULT_PD_PORT, DEFAULT_ENCODER_PORT]
    assert not [port for port in grpc_ports if port in LINUX_EPHEMERAL_PORTS]


def test_encoders_push_only_to_the_pds_the_proxy_routes_to(services):
    encoder = [str(token) for token in services["encoder"]["command"]]
    proxy = [str(token) for token in services["proxy"]["command"]]
    allowed = parse_epd_args(encoder).pd_allow.split(",")
    assert allowed == flag(proxy, "--pd").split(",") and "*" not in allowed


@pytest.fixture(scope="module")
def epd_services() -> dict:
    return load_compose(EPD_COMPOSE_FILE)["services"]


def test_docker_compose_config_validates_with_the_epd_override():
    import yaml

    for extra in ([], [GPU_COMPOSE_FILE]):
        args = [arg for path in (COMPOSE_FILE, *extra, EPD_COMPOSE_FILE) for arg in ("-f", str(path))]
        result = _docker_compose(*args, "--profile", "monitoring")
        assert result.returncode == 0, result.stderr
        merged = yaml.safe_load(result.stdout)["services"]
        assert set(merged) == {*SERVERS, "decode", *MONITORING}
        assert restart_blockers(merged) == [], extra
    # What the tests read (load_compose's merge) is what the engine runs.
    ours = load_compose(EPD_COMPOSE_FILE)["services"]
    result = _docker_compose("-f", str(COMPOSE_FILE), "-f", str(EPD_COMPOSE_FILE), "--profile", "monitoring")
    merged = yaml.safe_load(result.stdout)["services"]
    for name in ("pd", "decode", "encoder", "proxy"):
        assert merged[name]["command"] == ours[name]["command"], name
        assert merged[name].get("depends_on", {}) == ours[name].get("depends_on", {}), name
        assert merged[name]["healthcheck"]["test"] == ours[name]["healthcheck"]["test"], name
    (config,) = [v.split(":")[0] for v in merged["prometheus"]["volumes"] if ":/etc/prometheus/" in v]
    assert config.endswith("/deploy/prometheus.epd.yml")  # in place of prometheus.yml, not beside it


def test_epd_override_routes_prompts_to_prefill_and_generation_to_decode(epd_services):
    commands = {name: [str(t) for t in epd_services[name]["command"]] for name in (*SERVERS, "decode")}
    args = {name: parse_epd_args(argv) for name, argv in commands.items()}
    assert (args["pd"].role, args["decode"].role) == ("prefill", "decode")
    prefill = f"pd:{flag(commands['pd'], '--port')}"
    decode = f"decode:{flag(commands['decode'], '--port')}"
    assert flag(commands["proxy"], "--pd") == prefill and flag(commands["proxy"], "--decode") == decode
    # Encoders push only to the prefill PDs; prefill PDs push KV only to the decode PDs.
    assert args["encoder"].pd_allow.split(",") == [prefill]
    assert args["pd"].decode_allow.split(",") == [decode]
    assert args["decode"].host == "0.0.0.0" and "ports" not in epd_services["decode"]
    assert "container_name" not in epd_services["decode"], "decode scales with --scale decode=N"
    assert epd_services["proxy"]["depends_on"] == {
        name: {"condition": "service_healthy"} for name in ("pd", "encoder", "decode")
    }


def test_epd_decode_service_is_set_up_as_the_others(epd_services, services):
    decode, pd = epd_services["decode"], services["pd"]
    command = [str(t) for t in decode["command"]]
    assert decode["healthcheck"]["test"] == _grpc_health_test(command, "pd")
    assert {k: v for k, v in decode["healthcheck"].items() if k != "test"} == {
        k: v for k, v in pd["healthcheck"].items() if k != "test"
    }
    assert duration_s(decode["stop_grace_period"]) > grace_s(command)
    for key in ("image", "init", "build", "environment", "secrets", "restart"):
        assert decode[key] == pd[key], key
    port = int(flag(command, "--port"))
    assert port not in LINUX_EPHEMERAL_PORTS
    # Its own ports: one host running every service (the local test) needs them distinct.
    assert port != int(flag(pd["command"], "--port"))
    assert flag(command, "--metrics-port") != flag(pd["command"], "--metrics-port")


def test_epd_prometheus_scrapes_every_metrics_port(epd_services):
    import yaml

    config = yaml.safe_load((DEPLOY / "prometheus.epd.yml").read_text())
    targets = {
        (name, sd["port"]) for job in config["scrape_configs"] for sd in job["dns_sd_configs"] for name in sd["names"]
    }
    assert targets == {
        (name, int(flag(epd_services[name]["command"], "--metrics-port")))
        for name in ("proxy", "encoder", "pd", "decode")
    }
    for job in config["scrape_configs"]:
        assert job["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/epd_internal_token"}
    # Everything else is prometheus.yml's.
    base = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert {k: v for k, v in config.items() if k != "scrape_configs"} == {
        k: v for k, v in base.items() if k != "scrape_configs"
    }
    assert [job["job_name"] for job in config["scrape_configs"]] == [job["job_name"] for job in base["scrape_configs"]]


@pytest.mark.parametrize("override", [None, EPD_COMPOSE_FILE], ids=["base", "epd"])
def test_every_epd_service_is_hardened(override):
    """No capabilities, no-new-privileges, a read-only root with size-limited tmpfs where the services write,
    and a memory limit; after the engine's own merge too (docker-compose config, where installed)."""
    services = load_compose(*([override] if override else []))["services"]
    names = [name for name in EPD_SERVICES if name in services]
    assert len(names) == (4 if override else 3)
    assert [gap for name in names for gap in hardening_gaps_compose(name, services[name])] == []
    if shutil.which("docker-compose"):
        files = [COMPOSE_FILE, *([override] if override else [])]
        merged = yaml.safe_load(_docker_compose(*[a for path in files for a in ("-f", str(path))]).stdout)
        assert [gap for name in names for gap in hardening_gaps_compose(name, merged["services"][name])] == []


def test_the_compose_hardening_check_catches_a_gap(services):
    weakened = {**services["proxy"], "read_only": False, "tmpfs": ["/tmp:size=1m"]}
    assert hardening_gaps_compose("proxy", weakened) == [
        "proxy: writable root file system",
        "proxy: /var/cache/epd is not a size-limited tmpfs",
        "proxy: /home/epd is not a size-limited tmpfs",
    ]


@pytest.mark.parametrize("override", [None, EPD_COMPOSE_FILE], ids=["base", "epd"])
def test_only_the_proxy_is_on_the_public_network_and_the_rest_is_internal(override):
    compose = load_compose(*([override] if override else []))
    networks, services = compose["networks"], compose["services"]
    assert networks["internal"] == {"internal": True}  # no route off the host
    on = {name: set(service.get("networks", [])) for name, service in services.items()}
    assert {name for name, nets in on.items() if "public" in nets} == {"proxy"}
    assert on["proxy"] == {"public", "internal"}
    for name in set(EPD_SERVICES) - {"proxy"}:
        if name in services:
            assert on[name] == {"internal"}, name
            assert "ports" not in services[name], name
    assert on["prometheus"] == {"internal", "monitoring"} and on["grafana"] == {"monitoring"}

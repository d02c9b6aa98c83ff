"""``epd up``'s security and restart flags: the token it generates, what it forwards, what it refuses."""

from __future__ import annotations

import argparse

import pytest

from services.common import ports, security
from services.encoder import main as encoder_main
from services.encoder.config import EncoderConfig
from services.launcher import command as up
from services.launcher import ports as up_ports
from services.pd import main as pd_main
from services.pd.config import PdConfig
from services.proxy import main as proxy_main


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        "EPD_INTERNAL_TOKEN",
        "EPD_INTERNAL_TOKEN_FILE",
        "EPD_METRICS_REQUIRE_TOKEN",
        "EPD_AUTO_INTERNAL_TOKEN",
        "EPD_METRICS_HOST",
    ):
        monkeypatch.delenv(name, raising=False)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(argv)


def _env(argv: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    return up.launcher_security(_args(argv), environ or {})[1]


def test_a_fresh_token_is_generated_for_the_children_by_default(clean_env):
    first, second = _env([]), _env([])
    token = first[security.TOKEN_ENV]
    assert len(token) >= 32 and token != second[security.TOKEN_ENV]
    security.InternalSecurity(token=token)  # a valid token for every service
    specs = up.service_specs(_args([]), first)
    assert all(spec.env == first for spec in specs)
    assert all(token not in " ".join(spec.argv) for spec in specs)  # never on a command line (ps)


def test_a_given_token_is_used_and_none_is_generated(clean_env, tmp_path):
    (tmp_path / "token").write_text("given-token-0123456789")
    assert _env(["--internal-token-file", str(tmp_path / "token")]) == {}
    assert _env([], environ={security.TOKEN_ENV: "given-token-0123456789"}) == {}


def test_auto_token_can_be_turned_off(clean_env):
    assert _env(["--no-auto-internal-token"]) == {}


def test_metrics_require_token_reaches_the_children_and_needs_a_token(clean_env, capsys):
    transport, env = up.launcher_security(_args(["--metrics-require-token"]), {})
    assert env["EPD_METRICS_REQUIRE_TOKEN"] == "1" and transport.metrics_token == env[security.TOKEN_ENV]
    assert up.run(_args(["--metrics-require-token", "--no-auto-internal-token"])) == 2
    assert "needs an internal token" in capsys.readouterr().err


def test_metrics_endpoints_listen_on_loopback_whatever_the_host(clean_env):
    for spec in up.service_specs(_args(["--host", "0.0.0.0"])):
        if spec.kind != "proxy":
            argv = list(spec.argv)
            assert argv[argv.index("--host") + 1] == "0.0.0.0"
            assert argv[argv.index("--metrics-host") + 1] == "127.0.0.1"


def test_restart_flags_build_the_policy_and_bad_ones_are_usage_errors(clean_env, capsys):
    policy = up.restart_policy(_args(["--max-restarts", "2", "--restart-window-s", "30", "--restart-backoff-s", "0.5"]))
    assert (policy.max_restarts, policy.window_s, policy.backoff_s) == (2, 30.0, 0.5)
    assert up.run(_args(["--max-restarts", "-1"])) == 2
    assert "max_restarts" in capsys.readouterr().err


def test_health_flags_build_the_liveness_policy_and_bad_ones_are_usage_errors(clean_env, capsys):
    health = up.health_policy(
        _args(["--health-interval-s", "0.5", "--health-timeout-s", "1.5", "--health-failures", "4"])
    )
    assert (health.interval_s, health.timeout_s, health.max_failures) == (0.5, 1.5, 4)
    assert up.run(_args(["--health-timeout-s", "0"])) == 2
    assert "health" in capsys.readouterr().err


def _host_ephemeral_ports() -> range:
    """This machine's ``ip_local_port_range`` (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            low, high = (int(part) for part in file.read().split())
    except (OSError, ValueError):
        return ports.LINUX_EPHEMERAL_PORTS
    return range(low, high + 1)


def test_default_grpc_ports_are_outside_the_ephemeral_range(monkeypatch):
    """Security review: the gRPC defaults (50051, 50061) sat in Linux's ephemeral range."""
    for name in ("EPD_PORT", "EPD_PD", "EPD_ENCODER", "EPD_ENCODER_BASE_PORT", "EPD_PD_BASE_PORT"):
        monkeypatch.delenv(name, raising=False)
    defaults = []
    for module in (encoder_main, pd_main):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        defaults.append(parser.parse_args([]).port)
    proxy_parser = argparse.ArgumentParser()
    proxy_main.add_arguments(proxy_parser)
    proxy_args = proxy_parser.parse_args([])
    defaults += [int(proxy_args.encoder.rsplit(":", 1)[1]), int(proxy_args.pd.rsplit(":", 1)[1])]
    assert defaults == [ports.DEFAULT_ENCODER_PORT, ports.DEFAULT_PD_PORT] * 2
    assert EncoderConfig().port == ports.DEFAULT_ENCODER_PORT and PdConfig(model="m").port == ports.DEFAULT_PD_PORT
    # Every port a large default `epd up` binds: 10 encoders (the most before PD's port) and 16 PDs.
    cluster = up_ports.listening_ports(_args(["--encoders", "10", "--pds", "16"]))
    for port in [*defaults, *cluster]:
        assert port not in ports.LINUX_EPHEMERAL_PORTS and port not in _host_ephemeral_ports(), port
        assert port not in range(30000, 32768), port  # Kubernetes NodePorts
    assert len(set(cluster)) == len(cluster)


def test_encoders_may_push_only_to_this_clusters_pds(clean_env):
    specs = up.service_specs(_args(["--host", "10.0.0.5", "--encoders", "2", "--pds", "2", "--pd-base-port", "600"]))
    pds = [spec.address for spec in specs if spec.kind == "pd"]
    assert pds == ["10.0.0.5:600", "10.0.0.5:601"]
    encoders = [list(spec.argv) for spec in specs if spec.kind == "encoder"]
    assert len(encoders) == 2
    for argv in encoders:
        assert argv[argv.index("--pd-allow") + 1] == ",".join(pds)
    assert not any("--pd-allow" in spec.argv for spec in specs if spec.kind != "encoder")


def test_prefills_and_decodes_start_an_epd_cluster(clean_env):
    specs = up.service_specs(
        _args(["--host", "10.0.0.5", "--prefills", "2", "--decodes", "2", "--pd-base-port", "600"])
    )
    pds = [spec for spec in specs if spec.kind == "pd"]
    roles = [spec.argv[spec.argv.index("--role") + 1] for spec in pds]
    assert roles == ["prefill", "prefill", "decode", "decode"]
    prefills, decodes = "10.0.0.5:600,10.0.0.5:601", "10.0.0.5:602,10.0.0.5:603"
    proxy = list(next(spec for spec in specs if spec.kind == "proxy").argv)
    assert proxy[proxy.index("--pd") + 1] == prefills
    assert proxy[proxy.index("--decode") + 1] == decodes
    encoder = list(next(spec for spec in specs if spec.kind == "encoder").argv)
    assert encoder[encoder.index("--pd-allow") + 1] == prefills  # images go to prefill instances only
    proxy_args = argparse.ArgumentParser()
    proxy_main.add_arguments(proxy_args)
    config = proxy_main.config_from_args(proxy_args.parse_args(proxy[1:]))
    assert config.decode_addresses == tuple(decodes.split(","))
    assert all(config_role(spec) in ("prefill", "decode") for spec in pds)
    for spec in pds[:2]:  # prefill PDs push KV only to this cluster's decode PDs
        assert spec.argv[spec.argv.index("--decode-allow") + 1] == decodes
    assert not any("--decode-allow" in spec.argv for spec in pds[2:])


def config_role(spec) -> str:
    parser = argparse.ArgumentParser()
    pd_main.add_arguments(parser)
    return pd_main.config_from_args(parser.parse_args(list(spec.argv[1:]))).role


def test_default_cluster_has_no_roles_and_no_decode_list(clean_env):
    specs = up.service_specs(_args([]))
    assert not any("--role" in spec.argv or "--decode" in spec.argv for spec in specs)


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefills", "1"],
        ["--decodes", "1"],
        ["--prefills", "1", "--decodes", "1", "--pds", "2"],
        ["--prefills", "1", "--decodes", "1", "--colocated"],
    ],
)
def test_prefills_and_decodes_misuse_is_a_usage_error(argv):
    assert up._usage_error(_args(argv)) is not None


def test_epd_up_offers_the_proxys_pd_policies_and_default(clean_env, monkeypatch):
    # epd up may not import the proxy (it starts it as a process), so its flag repeats the proxy's.
    from services.proxy.backends.routing import DEFAULT_PD_POLICY, PD_POLICIES

    monkeypatch.delenv("EPD_PD_POLICY", raising=False)
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    (action,) = [a for a in parser._actions if a.dest == "pd_policy"]
    assert action.default == DEFAULT_PD_POLICY == "cache-aware"
    assert sorted(action.choices) == sorted(PD_POLICIES)

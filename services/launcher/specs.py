"""What ``epd up`` starts: one ``ServiceSpec`` per child, with its role, ports and command line.

Encoders, then PDs (``--pds`` of both roles, or ``--prefills`` then
``--decodes``), then the proxy that is told every address. The ports they
bind are listed, and checked before anything starts, in ``ports.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common import cli_args, security
from services.launcher.flags import with_port_offset


@dataclass(frozen=True)
class ServiceSpec:
    """How to start one service: ``python -m services.cli <argv>`` with extra environment."""

    name: str  # encoder-0, pd-1, proxy
    argv: tuple[str, ...]
    address: str  # host:port it serves on
    health_service: str | None  # gRPC health service meaning "ready"; None = HTTP /health
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # added to the launcher's own (secrets)

    @property
    def kind(self) -> str:
        return self.name.split("-")[0]


def service_specs(args: argparse.Namespace, env: dict[str, str] | None = None) -> list[ServiceSpec]:
    """Every child of ``epd up`` in start order: encoders, PDs, then the proxy.

    ``env`` is added to each child's environment (the generated token, the
    metrics switch; the spawner moves the token onto a pipe, ``secret_pipe``).
    Children get the model as the user named it: a preset resolves to the
    checkpoint built by the launcher (same cache directory) and keeps its
    served name. Their ports are those of the flags, ``--port-offset`` added.
    """
    args = with_port_offset(args)
    env = dict(env or {})
    common = _common_argv(args)
    device = ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]

    def grpc_service(
        kind: str, index: int, base_port: int, metrics_base_port: int, health_service: str, *extra: str
    ) -> ServiceSpec:
        argv = [
            kind,
            *common,
            *device,
            "--port",
            str(base_port + index),
            "--metrics-port",
            _metrics_port(metrics_base_port, index),
            "--metrics-host",
            args.metrics_host,
            *security.forward_argv(args, grpc_server=True),
            *extra,
        ]
        return ServiceSpec(f"{kind}-{index}", tuple(argv), f"{args.host}:{base_port + index}", health_service, env)

    # Encoders push only to this cluster's PDs (``epd encoder --pd-allow``), whatever an Encode names.
    roles = pd_roles(args)
    prefill_ports = [args.pd_base_port + j for j, role in enumerate(roles) if role != "decode"]
    # Prefill PDs push KV only to this cluster's decode PDs (``epd pd --decode-allow``).
    decode_ports = [f"{args.host}:{args.pd_base_port + j}" for j, role in enumerate(roles) if role == "decode"]
    pd_allow = ("--pd-allow", ",".join(f"{args.host}:{port}" for port in prefill_ports))
    specs = [
        grpc_service("encoder", i, args.encoder_base_port, args.encoder_metrics_base_port, "epd.v1.Encoder", *pd_allow)
        for i in range(0 if args.colocated else args.encoders)
    ]
    specs += [
        grpc_service(
            "pd",
            j,
            args.pd_base_port,
            args.pd_metrics_base_port,
            "epd.v1.PrefillDecode",
            *(["--encoder", "local"] if args.colocated else []),
            *(["--role", role] if role != "both" else []),
            *(["--decode-allow", ",".join(decode_ports)] if role == "prefill" else []),
        )
        for j, role in enumerate(roles)
    ]
    pd_addresses = [f"{args.host}:{port}" for port in prefill_ports]
    return [*specs, _proxy_spec(args, common, pd_addresses, specs, env)]


def _common_argv(args: argparse.Namespace) -> list[str]:
    """The flags every child gets: model, listen address, logging."""
    log_json = "--log-json" if args.log_json else "--no-log-json"
    return [
        "--model",
        args.model or cli_args.DEFAULT_MODEL,
        "--host",
        args.host,
        "--log-level",
        args.log_level,
        log_json,
    ]


def _proxy_spec(
    args: argparse.Namespace, common: list[str], pd_addresses: list[str], specs: list[ServiceSpec], env: dict[str, str]
) -> ServiceSpec:
    """The proxy, told every encoder and PD address in ``specs`` (``pd_addresses``: those taking new requests)."""
    decode_addresses = [spec.address for spec in specs if spec.kind == "pd" and spec.address not in pd_addresses]
    # Colocated: each PD serves epd.v1.Encoder on its own port.
    encoder_addresses = pd_addresses if args.colocated else [spec.address for spec in specs if spec.kind == "encoder"]
    proxy_argv = [
        "proxy",
        *common,
        "--port",
        str(args.port),
        "--pd",
        ",".join(pd_addresses),
        "--encoder",
        ",".join(encoder_addresses),
        *(["--decode", ",".join(decode_addresses)] if decode_addresses else []),
        "--pd-policy",
        args.pd_policy,
        "--encoder-policy",
        args.encoder_policy,
        "--metrics-port",
        str(args.proxy_metrics_port),
        "--metrics-host",
        args.metrics_host,
        *security.forward_argv(args, grpc_server=False),
    ]
    return ServiceSpec("proxy", tuple(proxy_argv), f"{args.host}:{args.port}", None, env)


def _metrics_port(base: int, index: int) -> str:
    return str(base + index if base >= 0 else -1)


def pd_roles(args: argparse.Namespace) -> list[str]:
    """The role of each PD process, in port order: ``--pds`` of both, or ``--prefills`` then ``--decodes``."""
    if args.prefills or args.decodes:
        return ["prefill"] * args.prefills + ["decode"] * args.decodes
    return ["both"] * args.pds

"""``epd health``: one readiness check, for container health checks and probes.

Exit status 0 means ready, 1 means not ready (or unreachable), 2 means a
usage error. It prints one line either way, which ``docker inspect`` and
``kubectl describe`` show next to the check.

- ``--address HOST:PORT --service NAME`` asks the standard gRPC health
  service (``grpc.health.v1``): ``--service ""`` means "the process is
  alive", ``epd.v1.PrefillDecode`` / ``epd.v1.Encoder`` mean "ready to
  serve" (model loaded, warm-up done, not draining).
- ``--http URL`` asks an HTTP endpoint (the proxy's ``/health``): ready
  when it answers 200.

Health needs no internal token, but with TLS the probe must speak TLS and with
mTLS present a certificate: it takes the services' ``--tls-*`` flags, so the
``EPD_TLS_*`` variables a container already has make its probe work as is.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.error
import urllib.parse
import urllib.request

from services.common import cli_args, security


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the health-check flags (each also read from ``EPD_<FLAG>``)."""
    add = cli_args.add_flag
    add(parser, "--address", default="", help="gRPC HOST:PORT to ask with the gRPC health protocol")
    add(
        parser,
        "--service",
        default="",
        help="gRPC health service name: '' = alive, epd.v1.PrefillDecode / epd.v1.Encoder = ready",
    )
    add(
        parser,
        "--http",
        default="",
        help="HTTP(S) URL that answers 200 when ready (the proxy's /health); instead of --address",
    )
    add(parser, "--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    security.add_arguments(parser, grpc_server=False)


def check_grpc(
    address: str, service: str, timeout: float, transport: security.InternalSecurity = security.NO_SECURITY
) -> bool:
    """True when ``address`` reports SERVING for ``service``; False otherwise or when unreachable."""
    # grpc_utils and the health stubs are loaded only for gRPC checks.
    from services.common.grpc_utils import check_health

    return asyncio.run(check_health(address, service, timeout=timeout, security=transport))


def check_http(url: str, timeout: float) -> tuple[bool, str]:
    """(ready, what happened): ready when ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as error:
        return False, f"HTTP {error.code}"
    except (OSError, ValueError) as error:  # URLError, refused, timeout
        return False, f"unreachable ({type(error).__name__})"


def _usage_error(args: argparse.Namespace) -> str | None:
    if bool(args.address) == bool(args.http):
        return "give exactly one of --address or --http"
    if args.http and urllib.parse.urlsplit(args.http).scheme not in ("http", "https"):
        return "--http needs an http:// or https:// URL"
    if args.timeout <= 0:
        return "--timeout must be positive"
    return None


def run(args: argparse.Namespace) -> int:
    """Runs one check; prints one line; returns 0 when ready, 1 when not, 2 on a usage error."""
    problem = _usage_error(args)
    if problem:
        print(f"epd health: {problem}", flush=True)
        return 2
    if args.http:
        ready, detail = check_http(args.http, args.timeout)
        target = args.http
    else:
        try:
            transport = security.from_args(args)
        except ValueError as error:
            print(f"epd health: {error}", flush=True)
            return 2
        ready = check_grpc(args.address, args.service, args.timeout, transport)
        detail = "SERVING" if ready else "not serving or unreachable"
        target = f"{args.address} service {args.service or '(alive)'}"
    print(f"epd health: {'ready' if ready else 'NOT READY'}: {target}: {detail}", flush=True)
    return 0 if ready else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m services.common.healthcheck ...`` (same flags as ``epd health``)."""
    parser = argparse.ArgumentParser(prog="epd health", description="check a service's readiness; exit 0 when ready")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

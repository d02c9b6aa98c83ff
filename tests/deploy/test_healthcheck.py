"""``epd health``: exit codes against a real gRPC health server and a real HTTP server."""

from __future__ import annotations

import asyncio
import http.server
import socket
import sys
import threading
from collections.abc import Iterator

import pytest
from cluster_support import free_ports

from services.common import grpc_utils, healthcheck

READY = "epd.v1.Encoder"


async def _health(*args: str) -> tuple[int, str]:
    """Runs the check as a process, as a container runtime does; returns (exit code, output)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.common.healthcheck",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=30)
    return process.returncode, output.decode()


@pytest.fixture
async def grpc_server():
    server = await grpc_utils.start_server("127.0.0.1", 0, READY, register=lambda s: None)
    try:
        yield server
    finally:
        await server.stop(0)


async def test_alive_is_serving_as_soon_as_the_server_runs(grpc_server):
    code, output = await _health("--address", f"127.0.0.1:{grpc_server.port}", "--service", "")
    assert code == 0, output
    assert output.count("\n") == 1 and "ready" in output


async def test_ready_follows_set_ready(grpc_server):
    address = f"127.0.0.1:{grpc_server.port}"
    code, output = await _health("--address", address, "--service", READY)
    assert code == 1 and "NOT READY" in output
    await grpc_server.set_ready(True)
    code, output = await _health("--address", address, "--service", READY, "--timeout", "5")
    assert code == 0, output
    await grpc_server.set_ready(False)  # what a draining server reports
    code, _ = await _health("--address", address, "--service", READY)
    assert code == 1


async def test_unknown_service_is_not_ready(grpc_server):
    code, output = await _health("--address", f"127.0.0.1:{grpc_server.port}", "--service", "epd.v1.Nope")
    assert code == 1 and "NOT READY" in output


async def test_unreachable_address_is_not_ready():
    (port,) = free_ports(1)
    code, output = await _health("--address", f"127.0.0.1:{port}", "--service", READY, "--timeout", "1")
    assert code == 1 and "NOT READY" in output


def test_epd_health_subcommand_runs_the_same_check():
    from services.cli import main

    (port,) = free_ports(1)
    assert main(["health", "--address", f"127.0.0.1:{port}", "--timeout", "1"]) == 1


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    """Answers GET /<code> with that HTTP status."""

    def do_GET(self) -> None:
        self.send_response(int(self.path.strip("/")))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_base() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StatusHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_http_200_is_ready(http_base, capsys):
    assert healthcheck.main(["--http", f"{http_base}/200"]) == 0
    assert "HTTP 200" in capsys.readouterr().out


def test_http_503_is_not_ready(http_base, capsys):
    assert healthcheck.main(["--http", f"{http_base}/503"]) == 1
    assert "HTTP 503" in capsys.readouterr().out


def test_http_unreachable_is_not_ready(capsys):
    (port,) = free_ports(1)
    assert healthcheck.main(["--http", f"http://127.0.0.1:{port}/health", "--timeout", "1"]) == 1
    assert "unreachable" in capsys.readouterr().out


def test_http_that_never_answers_times_out():
    with socket.socket() as silent:  # accepts connections (backlog) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/health"
        assert healthcheck.main(["--http", url, "--timeout", "0.5"]) == 1


def test_flags_default_from_the_environment(http_base, monkeypatch):
    monkeypatch.setenv("EPD_HTTP", f"{http_base}/200")
    assert healthcheck.main([]) == 0


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--address", "127.0.0.1:1", "--http", "http://127.0.0.1:1/"],
        ["--http", "file:///etc/passwd"],
        ["--address", "127.0.0.1:1", "--timeout", "0"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    assert healthcheck.main(argv) == 2
    assert capsys.readouterr().out.startswith("epd health: ")

"""``epd up``'s ports: checked before anything starts, named by their flag, moved together by ``--port-offset``."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher import command as up
from services.launcher import ports

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in [key for key in os.environ if key.startswith("EPD_")]:
        monkeypatch.delenv(name)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(argv)


@contextlib.contextmanager
def _held_port() -> Iterator[int]:
    """A loopback port another process would hold: bound and listening until the block ends."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free just now."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def _cluster_argv(port: int, *, metrics: int | None = None, offset: int = 0) -> list[str]:
    """A default cluster whose ports, ``offset`` added, are free ports (``--port`` and the PD metrics as given)."""
    free = _free_ports(6)
    given = [port, free[0], free[1], free[2], metrics if metrics is not None else free[3], free[4], free[5]]
    flags = [
        "--port",
        "--encoder-base-port",
        "--pd-base-port",
        "--encoder-metrics-base-port",
        "--pd-metrics-base-port",
        "--launcher-metrics-port",
        "--proxy-metrics-port",
    ]
    return [
        *(part for flag, value in zip(flags, given) for part in (flag, str(value - offset))),
        "--port-offset",
        str(offset),
    ]


def test_every_port_is_listed_with_its_flag_and_address():
    listed = ports.listeners(_args(["--encoders", "2", "--host", "0.0.0.0"]))
    assert [(item.port, item.flag, item.host) for item in listed] == [
        (8000, "--port", "0.0.0.0"),
        (21051, "--encoder-base-port", "0.0.0.0"),
        (21052, "--encoder-base-port + 1", "0.0.0.0"),
        (21061, "--pd-base-port", "0.0.0.0"),
        (9101, "--encoder-metrics-base-port", "127.0.0.1"),  # /metrics on --metrics-host, loopback by default
        (9102, "--encoder-metrics-base-port + 1", "127.0.0.1"),
        (9201, "--pd-metrics-base-port", "127.0.0.1"),
        (9300, "--launcher-metrics-port", "127.0.0.1"),
        (9099, "--proxy-metrics-port", "127.0.0.1"),
    ]


def test_a_clash_names_both_flags():
    problem = up._usage_error(_args(["--encoders", "11"]))
    assert problem == (
        "two services would listen on the same port 21061 (--encoder-base-port + 10 and --pd-base-port); "
        "move one of them, or turn metrics off (-1)"
    )


def test_a_port_beyond_the_range_is_refused():
    assert "port 65536 (--port, with --port-offset 1) is beyond 65535" in up._usage_error(
        _args(["--port", "65535", "--port-offset", "1"])
    )


def test_port_offset_moves_every_port_that_is_on():
    argv = ["--encoders", "2", "--pd-metrics-base-port", "-1", "--port-offset", "100"]
    assert ports.listening_ports(_args(argv)) == [8100, 21151, 21152, 21161, 9201, 9202, 9400, 9199]
    specs = {spec.name: list(spec.argv) for spec in up.service_specs(_args(argv))}
    assert {name: argv[argv.index("--port") + 1] for name, argv in specs.items()} == {
        "encoder-0": "21151",
        "encoder-1": "21152",
        "pd-0": "21161",
        "proxy": "8100",
    }
    assert specs["pd-0"][specs["pd-0"].index("--metrics-port") + 1] == "-1"  # off stays off
    assert specs["encoder-1"][specs["encoder-1"].index("--metrics-port") + 1] == "9202"
    proxy = specs["proxy"]
    assert proxy[proxy.index("--pd") + 1] == "127.0.0.1:21161"
    assert proxy[proxy.index("--metrics-port") + 1] == "9199"
    # Two clusters side by side: no port in common.
    assert not set(ports.listening_ports(_args(argv))) & set(ports.listening_ports(_args(argv[:-2])))


def test_a_taken_port_is_refused_with_its_flag_before_anything_starts(capsys):
    with _held_port() as port:
        assert up.run(_args(_cluster_argv(port))) == 2
    captured = capsys.readouterr()
    assert captured.err == f"epd: port {port} (--port) is already in use\n"
    assert "preparing model" not in captured.out  # nothing was started, not even the model's preparation


def test_a_taken_metrics_port_names_its_flag_and_the_offset(capsys):
    with _held_port() as port:
        assert up.run(_args(_cluster_argv(_free_ports(1)[0], metrics=port, offset=7))) == 2
    err = capsys.readouterr().err
    assert err == f"epd: port {port} (--pd-metrics-base-port, with --port-offset 7) is already in use\n"


def test_free_ports_pass_the_check():
    assert ports.taken(_args(_cluster_argv(_free_ports(1)[0]))) is None


def test_epd_up_on_a_taken_port_exits_2_at_once():
    """The real command: one line on stderr, exit code 2, no child started (how long it took is printed)."""
    with _held_port() as port:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "up", *_cluster_argv(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env={key: value for key, value in os.environ.items() if not key.startswith("EPD_")},
        )
        took = time.monotonic() - started
    print(f"epd up on a taken port: exit {done.returncode} after {took:.2f} s")
    assert done.returncode == 2
    assert done.stderr == f"epd: port {port} (--port) is already in use\n"
    assert done.stdout == ""

"""Every port ``epd up`` binds, with the flag that sets it, checked before anything starts.

The proxy's port, each encoder's and PD's gRPC port, each ``/metrics``
endpoint (the launcher's own included): two of them on one port, or one
that another process already holds, is refused with one line that names
the port and its flag, before the model is prepared or any child starts
(``command.py`` exits 2). A port is free when a listening socket can be
bound to it on the address its service will use (``--host``, or
``--metrics-host`` for ``/metrics``); the socket is closed at once.
"""

from __future__ import annotations

import argparse
import errno
import socket
from collections.abc import Callable
from dataclasses import dataclass

from services.launcher.flags import with_port_offset
from services.launcher.specs import pd_roles

HIGHEST_PORT = 65535


@dataclass(frozen=True)
class Listener:
    """One port the cluster binds: where, and which flag gives it (``--pd-base-port + 1``)."""

    port: int
    host: str
    flag: str


def listeners(args: argparse.Namespace) -> list[Listener]:
    """Every port the cluster binds, ``--port-offset`` applied: the proxy's, each gRPC server's, each /metrics'.

    Ports 0 (pick a free one) and -1 (off) bind nothing fixed and are left out.
    """
    shifted = with_port_offset(args)
    num_encoders = 0 if shifted.colocated else shifted.encoders
    num_pds = len(pd_roles(shifted))
    metrics_host = shifted.metrics_host or shifted.host  # '' = each service's --host
    ranges = [
        ("--port", shifted.port, 1, shifted.host),
        ("--encoder-base-port", shifted.encoder_base_port, num_encoders, shifted.host),
        ("--pd-base-port", shifted.pd_base_port, num_pds, shifted.host),
        ("--encoder-metrics-base-port", shifted.encoder_metrics_base_port, num_encoders, metrics_host),
        ("--pd-metrics-base-port", shifted.pd_metrics_base_port, num_pds, metrics_host),
        ("--launcher-metrics-port", shifted.launcher_metrics_port, 1, metrics_host),
        ("--proxy-metrics-port", shifted.proxy_metrics_port, 1, metrics_host),
    ]
    found = []
    for flag, base, count, host in ranges:
        if base < 0:  # -1 = off
            continue
        for i in range(count):
            if base + i > 0:
                found.append(Listener(base + i, host, flag if i == 0 else f"{flag} + {i}"))
    return found


def listening_ports(args: argparse.Namespace) -> list[int]:
    """The port numbers of ``listeners``."""
    return [listener.port for listener in listeners(args)]


def _offset_note(args: argparse.Namespace) -> str:
    offset = getattr(args, "port_offset", 0)
    return f", with --port-offset {offset}" if offset else ""


def clash(args: argparse.Namespace) -> str | None:
    """Two services on one port, or a port beyond 65535: the problem in one line, else None."""
    note = _offset_note(args)
    seen: dict[int, Listener] = {}
    for listener in listeners(args):
        if listener.port > HIGHEST_PORT:
            return f"port {listener.port} ({listener.flag}{note}) is beyond {HIGHEST_PORT}"
        first = seen.setdefault(listener.port, listener)
        if first is not listener:
            return (
                f"two services would listen on the same port {listener.port} ({first.flag} and {listener.flag}"
                f"{note}); move one of them, or turn metrics off (-1)"
            )
    return None


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on ``host:port`` now (``EADDRINUSE``: another process holds it), or None.

    Bound like the servers bind (``SO_REUSEADDR``), so that a port a stopped cluster left in TIME_WAIT
    counts as free, as it is for them.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as error:
        return error
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(1)
        except OSError as error:
            return error
    return None


def taken(args: argparse.Namespace, bind: Callable[[str, int], OSError | None] = bind_error) -> str | None:
    """The first port another process holds (or that cannot be bound), in one line naming its flag, else None."""
    note = _offset_note(args)
    for listener in listeners(args):
        error = bind(listener.host, listener.port)
        if error is None:
            continue
        where = f"port {listener.port} ({listener.flag}{note})"
        if isinstance(error, socket.gaierror):
            return f"{where}: cannot resolve {listener.host!r}: {error.strerror}"
        if error.errno == errno.EADDRINUSE:
            return f"{where} is already in use"
        return f"{where} cannot be bound on {listener.host}: {error.strerror or error}"
    return None

"""Which peers a service may dial with its credentials when a request names the address.

An encoder's Encode names the PD to push to (``epd encoder --pd-allow``); a
prefill PD's Generate names the decode PD to push KV to (``epd pd
--decode-allow``). The push carries the internal token and the service's
client certificate; without a check, any caller could have the service dial
an address of its choice with them. Each entry of the allow-list is
``host:port``:

- an IP literal (``10.0.0.7:21061``, ``[::1]:21061``) allows that address;
- a host name allows the name itself (``pd-0:21061``, as ``epd up`` and a
  gRPC name target send it) and every address it resolves to on that port:
  the proxy resolves a Kubernetes headless service or a scaled compose
  service to its pods' addresses and names those, so ``pd-headless:21061``
  allows every PD pod. Names are re-resolved when an address is not yet
  known, at most once per ``refresh_s`` (pods come and go);
- ``*`` allows any address (the behaviour before the list existed; logged as
  a warning at start-up).

With no list only loopback addresses are allowed (``localhost``,
``127.0.0.0/8``, ``::1``, any port): a single-host cluster works unchanged,
and nothing beyond the host is dialled until an operator says which peers
exist.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

ANY = "*"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> IP addresses``; a test seam, the default asks the system."""


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address of ``host`` from the system resolver (/etc/hosts, DNS)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (lower-case host, port); ValueError (naming no value) otherwise."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError("an address must be host:port with a port in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("an IPv6 address must be written [address]:port")
    if not host:
        raise ValueError("an address must be host:port with a port in 1..65535")
    return host.lower(), int(port_text)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _canonical(host: str) -> str:
    """An IP literal in one spelling (``::0001`` is ``::1``); a name as it is."""
    ip = _ip(host)
    return host if ip is None else str(ip)


def is_loopback(host: str) -> bool:
    ip = _ip(host)
    return host in LOOPBACK_NAMES if ip is None else ip.is_loopback


@dataclass(frozen=True)
class PdAllowSpec:
    """A parsed allow-list flag: ``entries`` of (host, port); ``any`` for ``*``; neither = loopback only."""

    entries: tuple[tuple[str, int], ...] = ()
    any: bool = False

    @classmethod
    def parse(cls, text: str | Iterable[str], flag: str = "--pd-allow") -> PdAllowSpec:
        """``"a:1,b:2"`` or a list of such strings; ``""`` = the loopback default. ValueError for a bad entry
        (naming ``flag``)."""
        items = text.split(",") if isinstance(text, str) else [part for t in text for part in t.split(",")]
        names = [item.strip() for item in items if item.strip()]
        if ANY in names:
            if len(names) > 1:
                raise ValueError(f"{flag} '*' allows every address; it cannot be combined with entries")
            return cls(any=True)
        return cls(entries=tuple(dict.fromkeys(split_host_port(name) for name in names)))

    def describe(self) -> str:
        """For the start-up log line: what is allowed (configuration, not request input)."""
        if self.any:
            return "any address"
        if not self.entries:
            return "loopback addresses only"
        return ", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.entries)


class PdAllowList:
    """Answers whether a request may name a peer address, resolving host-name entries as needed.

    ``allows`` never raises for a malformed address (it is simply not
    allowed); a failing resolver leaves the addresses known so far in place.
    """

    def __init__(
        self,
        spec: PdAllowSpec | None = None,
        *,
        resolver: Resolver = system_resolver,
        refresh_s: float = 1.0,
        lookup_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec or PdAllowSpec()
        self._resolver = resolver
        self._refresh_s = refresh_s  # at most one lookup round per period, however many unknown addresses arrive
        self._lookup_timeout_s = lookup_timeout_s  # a hung resolver must not hold Encodes for long
        self._clock = clock
        self._resolved: dict[tuple[str, int], frozenset[str]] = {}  # host-name entry -> the addresses it had
        self._resolved_at: float | None = None
        self._lock = asyncio.Lock()

    def _listed(self, host: str, port: int) -> bool:
        if self.spec.any:
            return True
        if not self.spec.entries:
            return is_loopback(host)
        return (host, port) in self.spec.entries or self._resolved_to(host, port)

    def _resolved_to(self, host: str, port: int) -> bool:
        return any(p == port and host in addresses for (_, p), addresses in self._resolved.items())

    async def allows(self, address: str) -> bool:
        """Whether ``address`` (``host:port``) is allowed; may resolve the list's host names once."""
        try:
            host, port = split_host_port(address)
        except ValueError:
            return False
        host = _canonical(host)
        if self._listed(host, port):
            return True
        # Only an IP address can be one a listed name resolves to, and only on that name's port.
        if not self.spec.entries or _ip(host) is None or not self._names_on(port):
            return False
        await self._refresh()
        return self._resolved_to(host, port)

    def _names_on(self, port: int) -> bool:
        return any(p == port and _ip(h) is None for h, p in self.spec.entries)

    async def _refresh(self) -> None:
        """Re-resolves every host-name entry, at most once per ``refresh_s`` (callers wait for one lookup)."""
        async with self._lock:
            now = self._clock()
            if self._resolved_at is not None and now - self._resolved_at < self._refresh_s:
                return
            self._resolved_at = now
            for entry in self.spec.entries:
                if _ip(entry[0]) is not None:
                    continue
                try:
                    async with asyncio.timeout(self._lookup_timeout_s):
                        addresses = await self._resolver(*entry)
                except (OSError, TimeoutError):
                    continue  # DNS hiccup: keep what this name was known to be
                self._resolved[entry] = frozenset(_canonical(address) for address in addresses)

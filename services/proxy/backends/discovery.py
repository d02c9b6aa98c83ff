"""Where the instances are: static addresses and DNS names, re-resolved periodically.

A target ``host:port`` whose host is an IP literal is one instance. A host
name may resolve to several addresses (a Kubernetes headless service, a
docker compose service scaled up): each address is its own instance, and the
set follows DNS on every refresh. Targets with a gRPC scheme (``dns:///``,
``unix:``) are passed to gRPC as they are: one instance, resolved by gRPC.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from services.proxy.backends.instances import Instance

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> IP addresses`` (strings). A test seam; the default asks the system."""


async def system_resolver(host: str, port: int) -> list[str]:
    """All addresses of ``host`` from the system resolver (/etc/hosts, DNS), in its order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: dict[str, None] = {}
    for _family, _type, _proto, _name, sockaddr in infos:
        seen.setdefault(str(sockaddr[0]), None)
    return list(seen)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Target:
    """One configured address (``spec``); ``host`` is None when gRPC resolves it itself."""

    spec: str
    host: str | None = None
    port: int = 0

    @property
    def needs_dns(self) -> bool:
        return self.host is not None and not is_ip(self.host)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_target(spec: str) -> Target:
    """``host:port`` / ``[v6]:port`` / a gRPC target with a scheme."""
    if "://" in spec or spec.startswith("unix:"):
        return Target(spec)
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"backend address must be host:port, got {spec!r}")
    return Target(spec, host.strip("[]"), int(port))


def prefer_one_family(addresses: Sequence[str]) -> list[str]:
    """IPv4 addresses when there are any, else the IPv6 ones.

    A dual-stack name such as ``localhost`` resolves to 127.0.0.1 *and* ::1
    for the same process; counting both would route to one server twice (and
    to an address it may not listen on).
    """
    v4 = [a for a in addresses if ipaddress.ip_address(a).version == 4]
    return v4 or list(addresses)


class Pool:
    """The live instances of one kind, kept in step with their targets.

    ``refresh()`` re-resolves the names: new addresses get an instance (and
    ``on_added``), vanished ones are retired (no new calls) and handed to
    ``on_removed`` once nothing of ours runs on them. A name that fails to
    resolve keeps its previous addresses: a DNS hiccup must not empty a pool.
    """

    def __init__(
        self,
        kind: str,
        targets: Iterable[str],
        make_instance: Callable[[str], Instance],
        *,
        resolver: Resolver = system_resolver,
        on_added: Callable[[Instance], None] = lambda instance: None,
        on_removed: Callable[[Instance], Awaitable[None]] | None = None,
    ) -> None:
        self.kind = kind
        self.targets = [parse_target(t) for t in targets]
        self._make_instance = make_instance
        self._resolver = resolver
        self._on_added = on_added
        self._on_removed = on_removed
        self._by_target: dict[str, list[str]] = {}  # spec -> addresses last resolved
        self._instances: dict[str, Instance] = {}  # address -> instance (listed ones)
        self._retired: list[Instance] = []

    @property
    def instances(self) -> list[Instance]:
        return list(self._instances.values())

    @property
    def has_dns_targets(self) -> bool:
        return any(t.needs_dns for t in self.targets)

    async def _addresses(self, target: Target) -> list[str]:
        if target.host is None:
            return [target.spec]
        if not target.needs_dns:
            return [join_host_port(target.host, target.port)]
        try:
            resolved = prefer_one_family(await self._resolver(target.host, target.port))
        except (OSError, ValueError) as error:
            log.warning(
                "%s target %s did not resolve (%s); keeping its previous addresses",
                self.kind,
                target.spec,
                type(error).__name__,
            )
            return self._by_target.get(target.spec, [])
        return [join_host_port(address, target.port) for address in resolved]

    async def refresh(self) -> None:
        """Resolves every target once and applies the differences."""
        wanted: dict[str, None] = {}
        for target in self.targets:
            addresses = await self._addresses(target)
            self._by_target[target.spec] = addresses
            for address in addresses:
                wanted.setdefault(address, None)
        for address in wanted:
            if address not in self._instances:
                instance = self._make_instance(address)
                self._instances[address] = instance
                log.info("%s %s added", self.kind, address)
                self._on_added(instance)
        for address in [a for a in self._instances if a not in wanted]:
            instance = self._instances.pop(address)
            instance.retired = True
            log.info("%s %s removed (no longer in DNS)", self.kind, address)
            self._retired.append(instance)
        await self.release_retired()

    async def release_retired(self, force: bool = False) -> None:
        """Hands retired instances with no calls of ours in flight to ``on_removed``."""
        keep = []
        for instance in self._retired:
            if instance.num_outstanding and not force:
                keep.append(instance)
            elif self._on_removed is not None:
                await self._on_removed(instance)
        self._retired = keep

    def all_instances(self) -> list[Instance]:
        """Listed and retired-but-busy instances (for shutdown)."""
        return [*self._instances.values(), *self._retired]

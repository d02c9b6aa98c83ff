"""Instance discovery: static addresses, DNS names with several addresses, re-resolution."""

from __future__ import annotations

import socket

import pytest

from services.proxy.backends.discovery import Pool, parse_target, prefer_one_family, system_resolver
from services.proxy.backends.instances import PdClient


class FakeChannel:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    async def close(self) -> None:
        pass


class FakeResolver:
    """name -> addresses, editable between refreshes; a missing name fails like DNS does."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        if host not in self.table:
            raise socket.gaierror("no such name")
        return list(self.table[host])


def make_pool(targets, resolver) -> tuple[Pool, list, list]:
    added, removed = [], []

    async def on_removed(instance) -> None:
        removed.append(instance.address)

    pool = Pool(
        "pd",
        targets,
        lambda address: PdClient(address, FakeChannel()),
        resolver=resolver,
        on_added=lambda instance: added.append(instance.address),
        on_removed=on_removed,
    )
    return pool, added, removed


@pytest.mark.parametrize(
    ("spec", "host", "port", "dns"),
    [
        ("10.0.0.1:21061", "10.0.0.1", 21061, False),
        ("[::1]:7", "::1", 7, False),
        ("pd.svc.cluster.local:21061", "pd.svc.cluster.local", 21061, True),
        ("dns:///pd:1", None, 0, False),
        ("unix:/tmp/pd.sock", None, 0, False),
    ],
)
def test_parse_target(spec, host, port, dns):
    target = parse_target(spec)
    assert (target.host, target.port, target.needs_dns) == (host, port, dns)


@pytest.mark.parametrize("spec", ["nohost", ":1", "host:", "host:0", "host:99999", "host:x"])
def test_parse_target_rejects(spec):
    with pytest.raises(ValueError):
        parse_target(spec)


def test_prefer_ipv4_when_a_name_has_both():
    assert prefer_one_family(["::1", "127.0.0.1"]) == ["127.0.0.1"]
    assert prefer_one_family(["fd00::1", "fd00::2"]) == ["fd00::1", "fd00::2"]


async def test_static_addresses_need_no_dns():
    resolver = FakeResolver({})
    pool, added, _ = make_pool(["10.0.0.1:1", "[fd00::5]:2"], resolver)
    await pool.refresh()
    assert [i.address for i in pool.instances] == ["10.0.0.1:1", "[fd00::5]:2"] == added
    assert resolver.calls == [] and not pool.has_dns_targets


async def test_one_name_becomes_one_instance_per_address_and_follows_dns():
    resolver = FakeResolver({"pd.svc": ["10.0.0.1", "10.0.0.2"]})
    pool, added, removed = make_pool(["pd.svc:21061", "10.0.0.9:21061"], resolver)
    await pool.refresh()
    assert [i.address for i in pool.instances] == ["10.0.0.1:21061", "10.0.0.2:21061", "10.0.0.9:21061"]
    assert resolver.calls == [("pd.svc", 21061)] and pool.has_dns_targets

    # Scale: one pod replaced, one added.
    first = pool.instances[0]
    resolver.table["pd.svc"] = ["10.0.0.2", "10.0.0.3"]
    await pool.refresh()
    assert [i.address for i in pool.instances] == ["10.0.0.2:21061", "10.0.0.9:21061", "10.0.0.3:21061"]
    assert added[-1] == "10.0.0.3:21061" and removed == ["10.0.0.1:21061"]
    assert first.retired and not first.routable()


async def test_a_retired_instance_is_released_only_when_idle():
    resolver = FakeResolver({"pd.svc": ["10.0.0.1"]})
    pool, _, removed = make_pool(["pd.svc:1"], resolver)
    await pool.refresh()
    busy = pool.instances[0]
    busy.num_outstanding = 1
    resolver.table["pd.svc"] = []
    await pool.refresh()
    assert pool.instances == [] and removed == [] and pool.all_instances() == [busy]
    busy.num_outstanding = 0
    await pool.release_retired()
    assert removed == ["10.0.0.1:1"] and pool.all_instances() == []


async def test_a_failed_lookup_keeps_the_previous_addresses():
    resolver = FakeResolver({"pd.svc": ["10.0.0.1", "10.0.0.2"]})
    pool, _, removed = make_pool(["pd.svc:1"], resolver)
    await pool.refresh()
    del resolver.table["pd.svc"]
    await pool.refresh()
    assert len(pool.instances) == 2 and removed == []


async def test_a_name_that_never_resolved_gives_an_empty_pool():
    pool, _, _ = make_pool(["missing.svc:1"], FakeResolver({}))
    await pool.refresh()
    assert pool.instances == []


async def test_system_resolver_answers_localhost_without_network():
    addresses = await system_resolver("localhost", 80)
    assert "127.0.0.1" in addresses or "::1" in addresses

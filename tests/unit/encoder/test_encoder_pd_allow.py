"""pd_allow.py: which PD addresses an Encode may name, with host names resolved as the proxy resolves them."""

from __future__ import annotations

import asyncio

import pytest

from services.encoder.pd_allow import PdAllowList, PdAllowSpec, split_host_port


class Resolver:
    """Answers from a table; counts lookups; raises OSError for a name it does not know."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.num_calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.num_calls += 1
        if host not in self.table:
            raise OSError("no such name")
        return self.table[host]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def allow_list(text: str, table: dict[str, list[str]] | None = None) -> tuple[PdAllowList, Resolver, Clock]:
    resolver, clock = Resolver(table or {}), Clock()
    return PdAllowList(PdAllowSpec.parse(text), resolver=resolver, clock=clock), resolver, clock


async def test_without_a_list_only_loopback_addresses_are_allowed():
    allowed, resolver, _ = allow_list("")
    for address in ("127.0.0.1:50061", "127.9.9.9:1", "[::1]:50061", "localhost:50061", "LOCALHOST:9"):
        assert await allowed.allows(address), address
    for address in ("10.0.0.7:50061", "169.254.169.254:80", "pd-0:50061", "[::ffff:10.0.0.1]:1", "0.0.0.0:1"):
        assert not await allowed.allows(address), address
    assert resolver.num_calls == 0  # the default never looks anything up


async def test_listed_addresses_are_allowed_exactly_and_nothing_else():
    allowed, _, _ = allow_list("10.0.0.7:50061,[2001:db8::1]:50061")
    assert await allowed.allows("10.0.0.7:50061")
    assert await allowed.allows("[2001:db8:0::0001]:50061")  # another spelling of the same address
    assert not await allowed.allows("10.0.0.7:50062")
    assert not await allowed.allows("10.0.0.8:50061")
    assert not await allowed.allows("127.0.0.1:50061")  # a list replaces the loopback default


async def test_a_host_name_allows_itself_and_the_addresses_it_resolves_to_on_its_port():
    allowed, resolver, _ = allow_list("pd-headless:50061", {"pd-headless": ["10.1.0.4", "10.1.0.5"]})
    assert await allowed.allows("PD-headless:50061")
    assert resolver.num_calls == 0  # the name itself needs no lookup
    assert await allowed.allows("10.1.0.4:50061") and await allowed.allows("10.1.0.5:50061")
    assert not await allowed.allows("10.1.0.4:50062")
    assert not await allowed.allows("pd-other:50061")  # a name is never resolved to judge it
    assert resolver.num_calls == 1


async def test_names_are_resolved_again_for_a_new_address_at_most_once_per_refresh():
    table = {"pd-headless": ["10.1.0.4"]}
    allowed, resolver, clock = allow_list("pd-headless:50061", table)
    assert not await allowed.allows("10.1.0.9:50061")
    table["pd-headless"] = ["10.1.0.4", "10.1.0.9"]  # a pod was added
    assert not await allowed.allows("10.1.0.9:50061")  # within the refresh period: no second lookup
    assert resolver.num_calls == 1
    clock.now += 1.0
    assert await allowed.allows("10.1.0.9:50061")
    assert resolver.num_calls == 2


async def test_a_failed_lookup_keeps_what_a_name_was_known_to_be():
    table = {"pd-headless": ["10.1.0.4"]}
    allowed, resolver, clock = allow_list("pd-headless:50061", table)
    assert await allowed.allows("10.1.0.4:50061")
    del table["pd-headless"]  # DNS hiccup
    clock.now += 5.0
    assert not await allowed.allows("10.1.0.5:50061")
    assert await allowed.allows("10.1.0.4:50061")
    assert resolver.num_calls == 2


async def test_a_hung_lookup_ends_at_its_timeout_and_the_address_is_refused():
    async def hangs(host: str, port: int) -> list[str]:
        await asyncio.sleep(60)
        return ["10.1.0.4"]

    allowed = PdAllowList(PdAllowSpec.parse("pd-headless:50061"), resolver=hangs, lookup_timeout_s=0.05)
    assert not await asyncio.wait_for(allowed.allows("10.1.0.4:50061"), 5)


async def test_an_ip_on_a_port_no_name_listens_on_is_refused_without_a_lookup():
    allowed, resolver, _ = allow_list("pd-headless:50061,10.0.0.7:7", {"pd-headless": ["10.1.0.4"]})
    assert not await allowed.allows("10.1.0.4:7")
    assert resolver.num_calls == 0


async def test_star_allows_any_address():
    allowed, _, _ = allow_list("*")
    assert await allowed.allows("203.0.113.9:443") and await allowed.allows("anything:1")
    assert PdAllowSpec.parse("*").describe() == "any address"


@pytest.mark.parametrize("address", ["", "pd", "pd:", ":50061", "pd:x", "pd:70000", "pd:0", "::1:5", "[]:5", "a b:1"])
async def test_a_malformed_address_is_simply_not_allowed(address):
    allowed, _, _ = allow_list("")
    assert not await allowed.allows(address)


@pytest.mark.parametrize("entry", ["pd", "pd:0", "pd:65536", "::1:5", "[]:5", "*,pd:1"])
def test_a_bad_entry_is_refused_without_repeating_it(entry):
    with pytest.raises(ValueError) as refused:
        PdAllowSpec.parse(entry)
    assert entry not in str(refused.value)


def test_entries_parse_from_lists_and_describe_themselves():
    spec = PdAllowSpec.parse(["pd-0:1,pd-1:2", "pd-0:1", "[::1]:3"])
    assert spec.entries == (("pd-0", 1), ("pd-1", 2), ("::1", 3))
    assert spec.describe() == "pd-0:1, pd-1:2, [::1]:3"
    assert PdAllowSpec().describe() == "loopback addresses only"
    assert split_host_port("[::1]:50061") == ("::1", 50061)

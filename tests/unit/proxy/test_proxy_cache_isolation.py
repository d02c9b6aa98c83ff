"""cache_isolation.py: which requests share cache entries, and what of the salt travels."""

from __future__ import annotations

import pytest

from services.common.hashing import check_cache_salt
from services.proxy.cache_isolation import CacheIsolation, tenant_salt
from services.proxy.web.fairness import address_identity, key_identity

SHARED, PER_CLIENT = CacheIsolation.SHARED, CacheIsolation.PER_CLIENT
ALICE, BOB = address_identity("10.0.0.1"), address_identity("10.0.0.2")


def test_shared_without_a_cache_salt_is_the_unsalted_cache_of_before():
    assert tenant_salt(SHARED, ALICE, None) == "" == tenant_salt(SHARED, BOB, None)


def test_per_client_gives_each_client_its_own_salt_and_the_same_client_the_same_one():
    alice, bob = tenant_salt(PER_CLIENT, ALICE, None), tenant_salt(PER_CLIENT, BOB, None)
    assert alice != bob and alice == tenant_salt(PER_CLIENT, ALICE, None)
    assert check_cache_salt(alice) == alice  # the wire form: 64 hex characters
    assert tenant_salt(PER_CLIENT, key_identity("k1"), None) != tenant_salt(PER_CLIENT, key_identity("k2"), None)


def test_a_cache_salt_narrows_a_tenant_and_never_reaches_another_tenants_entries():
    shared = tenant_salt(SHARED, ALICE, "s")
    assert shared == tenant_salt(SHARED, BOB, "s")  # shared mode: the same salt is the same cache (vLLM's rule)
    assert shared not in ("", tenant_salt(SHARED, ALICE, "t"))
    assert tenant_salt(PER_CLIENT, ALICE, "s") not in (tenant_salt(PER_CLIENT, BOB, "s"), shared)
    assert tenant_salt(PER_CLIENT, ALICE, "s") != tenant_salt(PER_CLIENT, ALICE, None)


@pytest.mark.parametrize(("a", "b"), [(("addr:1", "2x"), ("addr:12", "x")), (("", "addr:1"), ("addr:1", ""))])
def test_no_two_tenant_and_salt_pairs_share_a_digest(a, b):
    assert tenant_salt(PER_CLIENT, a[0], a[1]) != tenant_salt(PER_CLIENT, b[0], b[1])


def test_the_salt_a_client_chose_is_not_what_travels():
    wire = tenant_salt(SHARED, ALICE, "my-secret-salt")
    assert "my-secret-salt" not in wire and len(wire) == 64

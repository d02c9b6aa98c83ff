"""The proxy's side of per-tenant cache salts: the field's bounds, and what travels to encoder and PD."""

from __future__ import annotations

import logging

import httpx
import pytest
from proxy_doubles import image_message, png_data_url

from services.common.hashing import check_cache_salt
from services.proxy.cache_isolation import MAX_CACHE_SALT_CHARS, CacheIsolation

SECRET = "zebra-salt-42"
CHAT = {"messages": [image_message(png_data_url())], "max_tokens": 4}
COMPLETION = {"prompt": "Once", "max_tokens": 4}


def client_at(cluster, host: str) -> httpx.AsyncClient:
    """Another client of the same in-process proxy, seen from peer address ``host``."""
    transport = httpx.ASGITransport(app=cluster.app, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=10)


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1) + SECRET, 42, [SECRET], {"s": SECRET}])
async def test_a_bad_cache_salt_is_a_400_naming_the_field(cluster_factory, path, body, salt):
    cluster = await cluster_factory()
    reply = await cluster.client.post(path, json={**body, "cache_salt": salt})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "cache_salt"
    assert SECRET not in reply.text
    assert cluster.pd.generates == [] and cluster.pd.preallocates == []


async def test_shared_caches_send_no_salt_unless_the_request_has_one(cluster_factory, caplog):
    cluster = await cluster_factory()
    assert (await cluster.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    plain_hash = cluster.pd.preallocates[-1].items[0].mm_hash
    assert cluster.pd.preallocates[-1].cache_salt == cluster.pd.generates[-1].cache_salt == ""
    assert cluster.encoder.encodes[-1].cache_salt == ""
    with caplog.at_level(logging.DEBUG):
        reply = await cluster.client.post("/v1/chat/completions", json={**CHAT, "cache_salt": SECRET})
    assert reply.status_code == 200
    wire = cluster.pd.generates[-1].cache_salt
    assert check_cache_salt(wire) == wire != "" and SECRET not in wire
    assert cluster.pd.preallocates[-1].cache_salt == wire == cluster.encoder.encodes[-1].cache_salt
    assert cluster.pd.preallocates[-1].items[0].mm_hash != plain_hash  # the image is the tenant's own entry
    assert SECRET not in caplog.text
    assert (await cluster.client.post("/v1/completions", json={**COMPLETION, "cache_salt": SECRET})).status_code == 200
    assert cluster.pd.generates[-1].cache_salt == wire  # the same salt: the same cache, text or image


async def test_per_client_isolation_salts_each_client_apart(cluster_factory):
    cluster = await cluster_factory(cache_isolation=CacheIsolation.PER_CLIENT)
    salts, hashes = [], []
    for host in ("10.0.0.1", "10.0.0.2", "10.0.0.1"):
        async with client_at(cluster, host) as client:
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        salts.append(cluster.pd.generates[-1].cache_salt)
        hashes.append(cluster.pd.generates[-1].mm_items[0].mm_hash)
        assert cluster.encoder.encodes[-1].cache_salt == salts[-1] != ""
    assert salts[0] == salts[2] != salts[1] and hashes[0] == hashes[2] != hashes[1]

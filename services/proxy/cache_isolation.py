"""Per-tenant cache salts: who may be served from whose cache entries.

Every cache downstream (the encoder's embedding cache and single flight,
PD's embedding cache, PD's prefix cache) is keyed by content. Shared, a
response that comes back faster tells a client that someone else sent the
same image or prompt, however little ``usage`` says. A salt per tenant
splits the caches: the proxy folds it into each image's ``mm_hash`` and
sends it with the request, and PD seeds the first prefix-cache block's key
with it (vLLM's ``cache_salt``), so one tenant's entries never answer
another's request, while a tenant's repeated requests still hit its own.

A tenant is decided by ``--cache-isolation``:

- ``shared`` (default; the behaviour before salts): no salt of the proxy's
  own;
- ``per-client``: the client as the fairness limits count it, i.e. the API
  key's hash with ``--api-key`` (one key is one tenant), else the peer
  address.

A request's ``cache_salt`` (vLLM's extension, 1..``MAX_CACHE_SALT_CHARS``
characters) narrows the tenant further: requests share cache entries only
with requests of the same tenant and the same ``cache_salt``. A gateway
that serves several tenants under one key sets it per tenant.

What travels is a SHA-256 digest of (tenant, ``cache_salt``): the salt a
client chose is never sent, stored or logged.
"""

from __future__ import annotations

import enum
import hashlib

MAX_CACHE_SALT_CHARS = 256
"""Longest ``cache_salt`` a request may carry (vLLM suggests 43 base64 characters, 256 bits)."""


class CacheIsolation(enum.StrEnum):
    """Which requests may share cache entries (``--cache-isolation``)."""

    SHARED = "shared"
    PER_CLIENT = "per-client"


def tenant_salt(isolation: CacheIsolation, client: str, cache_salt: str | None) -> str:
    """The wire salt of a request: ``""`` (shared caches) or a 64-hex digest of its tenant and ``cache_salt``.

    ``client`` is the fairness identity (``key:…`` or ``addr:…``), used only
    under ``per-client``. Fields are length-prefixed, so no two (tenant,
    salt) pairs give the same digest input.
    """
    tenant = client if isolation is CacheIsolation.PER_CLIENT else ""
    if not tenant and not cache_salt:
        return ""
    digest = hashlib.sha256(b"epd-cache-salt-v1\0")
    for part in (tenant, cache_salt or ""):
        data = part.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()

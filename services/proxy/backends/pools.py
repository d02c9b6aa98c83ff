"""The PD and encoder pools, their routing policies, and the background keeping them current.

One long-lived channel per instance. ``Backends`` answers one question for
the pipeline: "which instances, best first?" (``pd_candidates`` /
``encoder_candidates``). Only routable instances are offered: ready (or
not yet checked), circuit breaker closed or probing, still listed in DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection

from services.proxy.backends.cache_index import RoutedPrompt
from services.proxy.backends.discovery import Pool
from services.proxy.backends.instances import EncoderClient, PdClient
from services.proxy.backends.monitor import Monitor, wait_known
from services.proxy.backends.routing import EncoderPolicy, PdPolicy

log = logging.getLogger(__name__)

INITIAL_HEALTH_WAIT_S = 2.0
"""How long start-up waits for the first health answers (instances are routable meanwhile)."""


class Backends:
    """PD and encoder pools with the policies that rank them."""

    def __init__(
        self,
        pd_pool: Pool,
        encoder_pool: Pool,
        *,
        pd_policy: PdPolicy,
        encoder_policy: EncoderPolicy,
        monitor: Monitor | None = None,
        dns_refresh_s: float = 5.0,
        decode_pool: Pool | None = None,
    ) -> None:
        """``decode_pool``: E+P+D's decode instances (``pd_pool`` then holds its prefill instances)."""
        self.pd_pool = pd_pool
        self.decode_pool = decode_pool
        self.encoder_pool = encoder_pool
        self.pd_policy = pd_policy
        self.encoder_policy = encoder_policy
        self.monitor = monitor
        self.dns_refresh_s = dns_refresh_s
        self._refresher: asyncio.Task | None = None
        self._started = False

    # -- lifecycle ------------------------------------------------------------
    async def start(self, initial_wait_s: float = INITIAL_HEALTH_WAIT_S) -> None:
        """Resolves the targets, starts watching them, and re-resolves names periodically (idempotent)."""
        if self._started:
            return
        self._started = True
        await self.pd_pool.refresh()
        await self.encoder_pool.refresh()
        if self.decode_pool is not None:
            await self.decode_pool.refresh()
        if any(pool.has_dns_targets for pool in self._pools):
            self._refresher = asyncio.create_task(self._refresh_forever(), name="dns refresh")
        if self.monitor is not None:
            await wait_known([*self.pds, *self.encoders, *self.decodes], initial_wait_s)

    @property
    def _pools(self) -> list[Pool]:
        return [self.pd_pool, self.encoder_pool] + ([self.decode_pool] if self.decode_pool is not None else [])

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh_s)
            for pool in self._pools:
                try:
                    await pool.refresh()
                except Exception:  # keep refreshing whatever one round did
                    log.exception("%s pool refresh failed", pool.kind)

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self.monitor is not None:
            await self.monitor.close()
        instances = [instance for pool in self._pools for instance in pool.all_instances()]
        await asyncio.gather(*(i.channel.close() for i in instances), return_exceptions=True)

    # -- routing --------------------------------------------------------------
    @property
    def pds(self) -> list[PdClient]:
        return self.pd_pool.instances  # type: ignore[return-value]

    @property
    def encoders(self) -> list[EncoderClient]:
        return self.encoder_pool.instances  # type: ignore[return-value]

    @property
    def decodes(self) -> list[PdClient]:
        """E+P+D's decode instances (none otherwise)."""
        return self.decode_pool.instances if self.decode_pool is not None else []  # type: ignore[return-value]

    def decode_candidates(self, exclude: Collection[str] = (), prompt: RoutedPrompt | None = None) -> list[PdClient]:
        """Routable decode instances not in ``exclude``, best first for ``prompt`` (the PD policy), then probing ones."""
        decodes = [d for d in self.decodes if d.address not in exclude]
        return self._rank_pds(decodes, prompt)

    def _rank_pds(self, pds: list[PdClient], prompt: RoutedPrompt | None) -> list[PdClient]:
        """The routable ones ranked by the PD policy, then the probing ones (ranked only when no other is)."""
        routable = [p for p in pds if p.routable()]
        last_resort = [p for p in pds if not p.routable() and p.last_resort()]
        if not routable:
            return self.pd_policy.rank(last_resort, prompt)
        return self.pd_policy.rank(routable, prompt) + (self.pd_policy.rank(last_resort) if last_resort else [])

    @property
    def has_encoders(self) -> bool:
        """Encoders are configured (whether or not any is up right now)."""
        return bool(self.encoder_pool.targets)

    def pd_candidates(self, exclude: Collection[str] = (), prompt: RoutedPrompt | None = None) -> list[PdClient]:
        """Routable PDs not in ``exclude``, best first for ``prompt``, then those probing (``last_resort``);
        may be empty."""
        pds = [p for p in self.pds if p.address not in exclude]
        return self._rank_pds(pds, prompt)

    def encoder_candidates(
        self, mm_hash: str, exclude: Collection[str] = (), pd_address: str | None = None
    ) -> list[EncoderClient]:
        """Routable encoders not in ``exclude`` for an image bound for ``pd_address``, best first.

        An address listed as both PD and encoder is a colocated PD: it can
        only fill its own reservations, so it is offered for images bound
        for itself (first: encoding in place moves no bytes) and never for
        another PD's.
        """
        pd_addresses = {p.address for p in self.pds}
        usable = [
            e
            for e in self.encoders
            if e.address not in exclude and (e.address not in pd_addresses or e.address == pd_address)
        ]
        ranked = self.encoder_policy.rank([e for e in usable if e.routable()], mm_hash) + self.encoder_policy.rank(
            [e for e in usable if not e.routable() and e.last_resort()], mm_hash
        )
        return sorted(ranked, key=lambda e: e.address != pd_address)  # stable: keeps the policy's order

    def health_report(self) -> dict[str, dict[str, bool]]:
        """Readiness of every listed instance: ``{"pd": {addr: ok}, "encoder": {addr: ok}}``.

        ``ok`` means health says SERVING and the circuit breaker is not open
        (``Instance.healthy``: a probe in flight does not make an instance unhealthy).
        """
        return {
            "pd": {p.address: p.healthy() for p in self.pds},
            "encoder": {e.address: e.healthy() for e in self.encoders},
        } | ({"decode": {d.address: d.healthy() for d in self.decodes}} if self.decode_pool is not None else {})

"""Helpers shared by the ``test_e2e_handoff_*`` tests (this module holds no tests itself).

``ProxyOnly`` puts one more proxy in front of backends that already run (a
cluster's PD and a chosen encoder), so a test can route some requests
through a faulty encoder and others through a healthy one, whatever the
proxy's routing policy is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
from cluster_support import InProcessCluster

MAX_TOKENS = 12


class ProxyOnly(InProcessCluster):
    """A proxy (on its own loop thread) for the given PD and encoder addresses; starts no backends."""

    def __init__(self, model_dir: str, pd_addresses: list[str], encoder_addresses: list[str], **proxy: Any) -> None:
        super().__init__(model_dir, num_encoders=0, num_pds=0, proxy=proxy)
        self._pd_addresses = list(pd_addresses)
        self._encoder_addresses = list(encoder_addresses)

    @property
    def pd_addresses(self) -> list[str]:
        return self._pd_addresses

    @property
    def encoder_addresses(self) -> list[str]:
        return self._encoder_addresses


@contextlib.contextmanager
def proxy_per_pd(model_dir: str, **proxy: Any) -> Iterator[tuple[InProcessCluster, list[ProxyOnly]]]:
    """Two PDs and an encoder in process, and one proxy per PD (each routes to its PD only) with ``proxy`` fields."""
    cluster = InProcessCluster(model_dir, num_pds=2, with_proxy=False).start()
    proxies: list[ProxyOnly] = []
    try:
        for pd in cluster.pd_addresses:
            proxies.append(ProxyOnly(model_dir, [pd], cluster.encoder_addresses, **proxy).start())
        yield cluster, proxies
    finally:
        for proxy_only in proxies:
            proxy_only.stop()
        cluster.stop()


def client_for(cluster: InProcessCluster, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=timeout)


def chat(client: openai.OpenAI, messages: list[dict], max_tokens: int = MAX_TOKENS) -> tuple[list[int], dict]:
    """Greedy completion: (token ids, the ``usage.epd`` extension)."""
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    return reply.choices[0].model_extra["token_ids"], (reply.usage.model_extra or {}).get("epd", {})

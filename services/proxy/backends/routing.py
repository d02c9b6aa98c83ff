"""Routing policies: pure functions of the instances' state (no I/O, no gRPC calls).

A policy ranks the *routable* instances (``Backends`` filters out not-ready,
breaker-open and retired ones first), best first; the pipeline tries them in
that order. Policies are chosen once at start-up by name (``--pd-policy``,
``--encoder-policy``), never per request. A PD policy is also given the
request's prompt (``RoutedPrompt``): the cache-aware one ranks by what each
PD's caches already hold of it (``cache_index.py``); the others ignore it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from services.proxy.backends.cache_index import CacheIndex, RouteDecision, RoutedPrompt
from services.proxy.backends.instances import EncoderClient, PdClient

DEFAULT_PD_POLICY = "cache-aware"
"""``--pd-policy``'s default: on the multi-turn benchmark its follow-up turns compute the fewest prompt tokens the
chats allow, and come sooner than ``least-loaded``'s (docs/benchmarks/multiturn.md)."""
DEFAULT_CACHE_WEIGHT = 2.0
"""``--pd-cache-weight``: a prompt token a PD would have to compute weighs this many tokens of its load."""


class PdPolicy(Protocol):
    def rank(self, instances: Sequence[PdClient], prompt: RoutedPrompt | None = None) -> list[PdClient]:
        """``instances`` best first for ``prompt`` (None: a request whose prompt does not matter)."""
        ...


class EncoderPolicy(Protocol):
    def rank(self, instances: Sequence[EncoderClient], mm_hash: str) -> list[EncoderClient]: ...


class _Rotation:
    """Rotating tie-breaker so equal instances share work instead of the first taking all."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def offsets(self, n: int) -> list[int]:
        start = next(self._counter) % n if n else 0
        return [(i - start) % n for i in range(n)]


class LeastLoadedPdPolicy:
    """PD: least outstanding work first.

    Work = this proxy's in-flight requests on the PD now + the other
    proxies' share of the PD's running and waiting requests at its last
    GetLoad. Instances that recently answered RESOURCE_EXHAUSTED go after
    the others; KV-cache usage and then rotation break ties.
    """

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def rank(self, instances: Sequence[PdClient], prompt: RoutedPrompt | None = None) -> list[PdClient]:
        offsets = self._rotation.offsets(len(instances))
        order = sorted(
            range(len(instances)),
            key=lambda i: (instances[i].is_busy(), instances[i].estimated_load(), instances[i].kv_usage(), offsets[i]),
        )
        return [instances[i] for i in order]


class RoundRobinPdPolicy:
    """PD: rotate through the instances, ignoring load (recently busy ones last)."""

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def rank(self, instances: Sequence[PdClient], prompt: RoutedPrompt | None = None) -> list[PdClient]:
        offsets = self._rotation.offsets(len(instances))
        order = sorted(range(len(instances)), key=lambda i: (instances[i].is_busy(), offsets[i]))
        return [instances[i] for i in order]


class CacheAwarePdPolicy:
    """PD: where the request costs least, counting the prompt tokens each PD would compute against its load.

    For each PD, ``hit`` is what its caches hold of the prompt (``CacheIndex.hit``: the longest run of the
    prompt's blocks in its prefix cache, plus the images past that run whose embeddings it holds, at
    their token length), and

        cost = cache_weight * (prompt tokens - hit) + load

    where ``load`` is the work in flight on the PD (``PdClient.estimated_tokens``): the uncached tokens of
    the requests it serves, prompt tokens it had to compute plus output tokens so far (this proxy's now, the
    others' from GetLoad). Both terms count tokens a PD computes; a cached token costs nothing in either, so
    a shared system prompt neither attracts nor, once everywhere, weighs. Lowest cost first; PDs that recently answered
    RESOURCE_EXHAUSTED go last, then KV-cache usage and rotation break ties. ``cache_weight`` is the one
    knob: 0 routes by token load alone; larger keeps a conversation where its prefix is until the other PDs'
    load is lower by more than ``cache_weight`` times the tokens it would recompute there. Without a prompt
    (or without events) every hit is 0 and the order is by load.

    A prompt that every PD holds equally much of (a new conversation: its shared system prompt is everywhere)
    goes by its load plus ``PdClient.returning_tokens``, the work of the calls that finished there lately:
    the conversations a PD already holds come back to it, and a PD whose users are between turns is not idle.
    By load alone such a PD drew the new conversations and kept them (a run of 8 chats on 2 PDs placed 5 and 3).

    Sets ``prompt.decision`` (why the first PD is first) for metrics and logs.
    """

    def __init__(self, index: CacheIndex | None = None, cache_weight: float = DEFAULT_CACHE_WEIGHT) -> None:
        if not cache_weight >= 0:
            raise ValueError("cache_weight must be >= 0")
        self.index = index if index is not None else CacheIndex()
        self.cache_weight = cache_weight
        self._rotation = _Rotation()

    def rank(self, instances: Sequence[PdClient], prompt: RoutedPrompt | None = None) -> list[PdClient]:
        if not instances:
            return []
        offsets = self._rotation.offsets(len(instances))
        hits = [0 if prompt is None else self.index.hit(pd.address, prompt).tokens for pd in instances]
        loads = [pd.estimated_tokens() for pd in instances]
        if prompt is not None and max(hits) == min(hits):
            loads = [load + round(pd.returning_tokens()) for load, pd in zip(loads, instances)]
        num_tokens = 0 if prompt is None else prompt.num_tokens
        costs = [self.cache_weight * (num_tokens - hit) + load for hit, load in zip(hits, loads)]
        order = sorted(
            range(len(instances)), key=lambda i: (instances[i].is_busy(), costs[i], instances[i].kv_usage(), offsets[i])
        )
        if prompt is not None:
            best, first = max(hits), order[0]
            reason = "load" if best == min(hits) else "cache" if hits[first] == best else "load_over_cache"
            prompt.decision = RouteDecision(instances[first].address, reason, hits[first], best, loads[first])
        return [instances[i] for i in order]


def rendezvous_weight(address: str, mm_hash: str) -> int:
    """Highest-random-weight score of (instance, image); stable across processes."""
    digest = hashlib.blake2b(f"{address}\0{mm_hash}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class RendezvousPolicy:
    """Encoder: rendezvous hashing on ``mm_hash`` for cache affinity, with a saturation fallback.

    A repeated image lands on the encoder that has it cached, and adding or
    removing an encoder moves only that encoder's images. When the preferred
    encoder is saturated (``saturation`` images or more in flight, or it just
    answered RESOURCE_EXHAUSTED), the least-loaded unsaturated encoder goes
    first instead: a cache miss there beats queueing behind a hot spot.
    """

    def __init__(self, saturation: int = 16) -> None:
        if saturation < 1:
            raise ValueError("saturation must be >= 1")
        self.saturation = saturation

    def saturated(self, encoder: EncoderClient) -> bool:
        return encoder.is_busy() or encoder.estimated_load() >= self.saturation

    def rank(self, instances: Sequence[EncoderClient], mm_hash: str) -> list[EncoderClient]:
        by_weight = sorted(instances, key=lambda e: -rendezvous_weight(e.address, mm_hash))
        if not by_weight or not self.saturated(by_weight[0]):
            return by_weight
        free = [e for e in by_weight if not self.saturated(e)]
        full = [e for e in by_weight if self.saturated(e)]
        return sorted(free, key=lambda e: e.estimated_load()) + full  # stable: weight breaks load ties


class LeastLoadedEncoderPolicy:
    """Encoder: fewest images in flight first (no affinity); rotation breaks ties."""

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def rank(self, instances: Sequence[EncoderClient], mm_hash: str) -> list[EncoderClient]:
        offsets = self._rotation.offsets(len(instances))
        order = sorted(
            range(len(instances)), key=lambda i: (instances[i].is_busy(), instances[i].estimated_load(), offsets[i])
        )
        return [instances[i] for i in order]


class RoundRobinEncoderPolicy:
    """Encoder: rotate through the instances (no affinity, no load)."""

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def rank(self, instances: Sequence[EncoderClient], mm_hash: str) -> list[EncoderClient]:
        offsets = self._rotation.offsets(len(instances))
        order = sorted(range(len(instances)), key=lambda i: (instances[i].is_busy(), offsets[i]))
        return [instances[i] for i in order]


PD_POLICIES: dict[str, Callable[[], PdPolicy]] = {
    "cache-aware": CacheAwarePdPolicy,
    "least-loaded": LeastLoadedPdPolicy,
    "round-robin": RoundRobinPdPolicy,
}
ENCODER_POLICIES = {
    "rendezvous": RendezvousPolicy,
    "least-loaded": LeastLoadedEncoderPolicy,
    "round-robin": RoundRobinEncoderPolicy,
}


def make_pd_policy(
    name: str, *, cache_index: CacheIndex | None = None, cache_weight: float = DEFAULT_CACHE_WEIGHT
) -> PdPolicy:
    """The policy ``name``; ``cache_index`` and ``cache_weight`` are the cache-aware policy's."""
    if name == "cache-aware":
        return CacheAwarePdPolicy(cache_index, cache_weight)
    return PD_POLICIES[name]()


def make_encoder_policy(name: str, *, saturation: int) -> EncoderPolicy:
    if name == "rendezvous":
        return RendezvousPolicy(saturation)
    return ENCODER_POLICIES[name]()

"""Per-client limits at the proxy: requests in flight and a token bucket over requested work.

Pure Python (no I/O, an injectable clock), so the policy is tested without
a server. ``ClientLimiter.admit`` either refuses with a 429 ``ApiError`` or
returns an ``Admission`` that the caller must ``release`` once, on every
exit path (release is idempotent).

A client is the API key when ``--api-key`` is set (a short hash of it, so
the key is never logged or echoed), else the peer address. Behind a load
balancer or reverse proxy the peer address is the balancer's, so every
client behind it shares one allowance.

Invariant: once every admission is released, ``num_in_flight`` is empty
(``check_idle``); a bucket never holds more than ``tokens_per_minute``.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.proxy.errors import ApiError

REFUSAL_REASONS = ("requests", "tokens")
"""Labels of the refusal counter: too many requests in flight, or the token bucket is empty."""
_MIN_SWEEP = 1024  # buckets kept before full (idle) ones are swept


def key_identity(api_key: str) -> str:
    """The client name of an API key: a short hash (the key itself is never stored, logged or echoed)."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def address_identity(host: str | None) -> str:
    """The client name of a peer address (unknown peers share one name)."""
    return "addr:" + (host or "unknown")


@dataclass(frozen=True)
class FairnessLimits:
    """Per-client caps; 0 = off (the default for both)."""

    max_requests: int = 0  # requests in flight per client; a request with n choices counts as n
    tokens_per_minute: int = 0  # prompt + max_tokens × n per client, refilled continuously

    @property
    def enabled(self) -> bool:
        return self.max_requests > 0 or self.tokens_per_minute > 0


@dataclass
class _Bucket:
    tokens: float
    updated: float


@dataclass
class Admission:
    """One admitted request's hold on its client's allowance; ``release`` gives it back once."""

    limiter: ClientLimiter | None
    client: str
    num_requests: int  # slots held (n)
    reserved_completion_tokens: int  # max_tokens × n, charged at admission
    used_completion_tokens: int = 0  # added as tokens arrive; the rest is refunded at release
    released: bool = field(default=False)

    def add_used(self, num_tokens: int) -> None:
        self.used_completion_tokens += num_tokens

    def release(self) -> None:
        """Frees the request slots and refunds unused completion tokens; later calls do nothing."""
        if self.released:
            return
        self.released = True
        if self.limiter is not None:
            self.limiter._release(self)


class ClientLimiter:
    """Admission by client: at most ``max_requests`` in flight and a ``tokens_per_minute`` bucket.

    ``on_refusal(reason)`` is called for every 429 (``reason`` in
    ``REFUSAL_REASONS``; the client is never a label). ``clock`` returns
    seconds (monotonic); tests pass a fake one.
    """

    def __init__(
        self,
        limits: FairnessLimits,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_refusal: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._on_refusal = on_refusal
        self.num_in_flight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._next_sweep = _MIN_SWEEP

    def admit(self, client: str, *, num_choices: int, prompt_tokens: int, max_tokens: int) -> Admission:
        """Charges one request (``num_choices`` × (slot, ``max_tokens``) + ``prompt_tokens``) or raises a 429."""
        reserved = max_tokens * num_choices
        if not self.limits.enabled:
            return Admission(None, client, num_choices, reserved)
        held = self.num_in_flight.get(client, 0)
        if self.limits.max_requests and held + num_choices > self.limits.max_requests:
            self._on_refusal("requests")
            raise too_many_requests(
                f"Too many requests in flight for this client (limit {self.limits.max_requests}).", 1
            )
        cost = prompt_tokens + reserved
        bucket = self._refilled(client)
        if bucket is not None:
            if cost > self.limits.tokens_per_minute:
                self._on_refusal("tokens")
                raise too_many_requests(
                    f"This request asks for {cost} tokens, more than this client's "
                    f"{self.limits.tokens_per_minute} per minute; lower max_tokens or n.",
                    60,
                )
            if cost > bucket.tokens:
                self._on_refusal("tokens")
                raise too_many_requests(
                    f"Token rate limit reached for this client ({self.limits.tokens_per_minute} per minute).",
                    self._seconds_until(bucket, cost),
                )
            bucket.tokens -= cost
        self.num_in_flight[client] = held + num_choices
        return Admission(self, client, num_choices, reserved)

    def check_idle(self) -> None:
        """Asserts nothing is held (after every admission is released)."""
        assert not self.num_in_flight, f"requests still counted: {sorted(self.num_in_flight.values())}"

    def _release(self, admission: Admission) -> None:
        held = self.num_in_flight.get(admission.client, 0) - admission.num_requests
        if held > 0:
            self.num_in_flight[admission.client] = held
        else:
            self.num_in_flight.pop(admission.client, None)
        unused = admission.reserved_completion_tokens - admission.used_completion_tokens
        bucket = self._refilled(admission.client)
        if bucket is not None and unused > 0:
            bucket.tokens = min(float(self.limits.tokens_per_minute), bucket.tokens + unused)

    def _refilled(self, client: str) -> _Bucket | None:
        """The client's bucket brought up to now (None when the token limit is off).

        Full buckets are dropped, so idle clients cost no memory.
        """
        capacity = self.limits.tokens_per_minute
        if not capacity:
            return None
        now = self._clock()
        self._drop_full_buckets(now)
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = _Bucket(float(capacity), now)
        else:
            bucket.tokens = min(float(capacity), bucket.tokens + (now - bucket.updated) * capacity / 60.0)
            bucket.updated = now
        return bucket

    def _drop_full_buckets(self, now: float) -> None:
        capacity = self.limits.tokens_per_minute
        if len(self._buckets) < self._next_sweep:  # amortised O(1): the table doubles between sweeps
            return
        for client, bucket in list(self._buckets.items()):
            if bucket.tokens + (now - bucket.updated) * capacity / 60.0 >= capacity:
                del self._buckets[client]
        self._next_sweep = max(_MIN_SWEEP, 2 * len(self._buckets))

    def _seconds_until(self, bucket: _Bucket, cost: int) -> int:
        missing = cost - bucket.tokens
        return max(1, math.ceil(missing * 60.0 / self.limits.tokens_per_minute))


def too_many_requests(message: str, retry_after_s: int) -> ApiError:
    """The OpenAI 429 for a per-client limit, with ``Retry-After``."""
    return ApiError(429, message, "rate_limit_error", "too_many_requests", retry_after_s=retry_after_s)

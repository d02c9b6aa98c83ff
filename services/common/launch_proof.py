"""Proof that a listener is the child ``epd up`` started, not a process that took its port.

(The proxy's HTTP ``/health`` answers the same challenge: request header
``epd-launch-challenge``, response header ``epd-launch-proof``.)

While a child of ``epd up`` restarts, its port is free: any local process
can bind it and answer health checks. Such a listener must neither be taken
for the child nor be sent the internal token. So each child of one ``epd
up`` run (each slot: ``pd-0``, ``encoder-1``, ...) gets a random key of its
own, the **launch key** (256 bits), as ``EPD_LAUNCH_KEY`` (like the token it
never appears on a command line, and it reaches the child on a pipe, not in
its environment: ``secret_pipe``). The launcher knows every key; the proxy is given those
of the encoders and PDs it calls (``EPD_PEER_LAUNCH_KEYS``), since it is the
one that sends them the token.

A verifier (the launcher's readiness and liveness checks; the proxy, on
every newly opened health watch, before the instance is routable again)
proves a listener with a challenge-response on the health RPC, which needs
no token (and no client sends it there, ``security``):

1. it sends ``Health/Check`` with metadata ``epd-launch-challenge``: a
   fresh random value (128 bits) for every check, so an answer cannot be
   replayed;
2. the child answers in its trailing metadata ``epd-launch-proof`` =
   HMAC-SHA256(launch key, ``"epd-launch-proof\\0" + challenge``);
3. the launcher compares with ``hmac.compare_digest``. A check without the
   right proof fails like an unanswered one: the child is not ready, and a
   running one that keeps failing is killed and restarted.

Why it holds: a listener that is not the child has no launch key, and the
challenge is unpredictable, so it cannot compute the proof, nor reuse one it
collected earlier from the genuine child (anyone may send it challenges of
their choosing; the verifier's will not be among them). It cannot relay the
challenge to a genuine child either: every other child has a different key,
and the genuine child for this port cannot be listening on it (the impostor
holds it; servers bind without ``SO_REUSEPORT``). The proof is keyed, so it
reveals nothing about the key. A fresh run of ``epd up`` draws new keys.

What it does not cover: a connection that drops and is re-established
between the proxy's check and its next call (the watch stream ends with the
connection, which takes the instance out of rotation, so the window is that
of one event-loop turn), and an encoder's push to a PD (the encoder dials
the PD the proxy picked, which the proxy had verified, but on a connection
of its own).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping

LAUNCH_KEY_ENV = "EPD_LAUNCH_KEY"
"""Environment variable carrying a child's own launch key (hex)."""
PEER_KEYS_ENV = "EPD_PEER_LAUNCH_KEYS"
"""Environment variable of the proxy: ``host:port=key`` of each peer, comma-separated."""
CHALLENGE_METADATA_KEY = "epd-launch-challenge"
"""gRPC metadata key of the launcher's challenge on a health call."""
PROOF_METADATA_KEY = "epd-launch-proof"
"""Trailing metadata key of the child's answer."""
MAX_CHALLENGE_CHARS = 128
"""A longer challenge is not answered (the launcher sends 32 hex characters)."""
_DOMAIN = b"epd-launch-proof\0"


def new_launch_key() -> str:
    """A fresh key for one child of one run."""
    return secrets.token_hex(32)


def format_peer_keys(keys: Mapping[str, str]) -> str:
    """``{address: key}`` as ``PEER_KEYS_ENV``'s value."""
    return ",".join(f"{address}={key}" for address, key in keys.items())


def parse_peer_keys(text: str) -> tuple[tuple[str, str], ...]:
    """``PEER_KEYS_ENV``'s value as ``(address, key)`` pairs (ValueError when malformed)."""
    pairs = []
    for item in filter(None, text.split(",")):
        address, sep, key = item.partition("=")
        if not sep or not address or not key:
            raise ValueError(f"${PEER_KEYS_ENV}: expected host:port=key items")
        pairs.append((address, key))
    return tuple(pairs)


def new_challenge() -> str:
    """A fresh challenge for one check."""
    return secrets.token_hex(16)


def proof(launch_key: str, challenge: str) -> str:
    """What a child holding ``launch_key`` answers to ``challenge``."""
    return hmac.new(launch_key.encode(), _DOMAIN + challenge.encode(), hashlib.sha256).hexdigest()


def _value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The value under ``key``: gRPC metadata, or HTTP headers (whose names are case-insensitive)."""
    for name, value in metadata or ():
        if name.lower() == key:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def answer(launch_key: str, invocation_metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The child's side: the proof for the call's challenge, or None when it carries none (or a bad one)."""
    challenge = _value(invocation_metadata, CHALLENGE_METADATA_KEY)
    if challenge is None or not 0 < len(challenge) <= MAX_CHALLENGE_CHARS or not challenge.isascii():
        return None
    return proof(launch_key, challenge)


def verify(launch_key: str, challenge: str, trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """The launcher's side: whether the reply's trailers carry the right proof (constant time)."""
    given = _value(trailing_metadata, PROOF_METADATA_KEY)
    return given is not None and hmac.compare_digest(given.encode(), proof(launch_key, challenge).encode())

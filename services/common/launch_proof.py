"""Proof that a listener is the child ``epd up`` started, not a process that took its port.

While a child of ``epd up`` restarts, its port is free: any local process
can bind it and answer health checks. Such a listener must neither be taken
for the child nor be sent the internal token. So each start of a child gets
a fresh random key, the **launch key** (256 bits), in its environment
(``EPD_LAUNCH_KEY``; like the token it never appears on a command line, and
``/proc/<pid>/environ`` is readable only by the same user, who could read
the token anyway). Only the launcher and that one process know it.

The launcher proves a listener with a challenge-response on the health
RPC, which needs no token (nothing secret is ever sent to the listener):

1. it sends ``Health/Check`` with metadata ``epd-launch-challenge``: a
   fresh random value (128 bits) for every check, so an answer cannot be
   replayed;
2. the child answers in its trailing metadata ``epd-launch-proof`` =
   HMAC-SHA256(launch key, ``"epd-launch-proof\\0" + challenge``);
3. the launcher compares with ``hmac.compare_digest``. A check without the
   right proof fails like an unanswered one: the child is not ready, and a
   running one that keeps failing is killed and restarted.

Why it holds: a listener that is not the child has no launch key, and the
challenge is unpredictable, so it cannot compute the proof. It cannot get
one from a genuine child either: every other child has a different key, and
the genuine child for this port cannot be listening on it (the impostor
holds it; servers bind without ``SO_REUSEPORT``). A key leaked from an
earlier start is worthless, since every start gets a new one. The proof is
keyed, so it reveals nothing about the key. The launcher itself never sends
the token on a health call, verified or not.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

LAUNCH_KEY_ENV = "EPD_LAUNCH_KEY"
"""Environment variable carrying one start's launch key to the child (hex)."""
CHALLENGE_METADATA_KEY = "epd-launch-challenge"
"""gRPC metadata key of the launcher's challenge on a health call."""
PROOF_METADATA_KEY = "epd-launch-proof"
"""Trailing metadata key of the child's answer."""
MAX_CHALLENGE_CHARS = 128
"""A longer challenge is not answered (the launcher sends 32 hex characters)."""
_DOMAIN = b"epd-launch-proof\0"


def new_launch_key() -> str:
    """A fresh key for one start of one child."""
    return secrets.token_hex(32)


def new_challenge() -> str:
    """A fresh challenge for one check."""
    return secrets.token_hex(16)


def proof(launch_key: str, challenge: str) -> str:
    """What a child holding ``launch_key`` answers to ``challenge``."""
    return hmac.new(launch_key.encode(), _DOMAIN + challenge.encode(), hashlib.sha256).hexdigest()


def _value(metadata: Sequence[tuple[str, str | bytes]] | None, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def answer(launch_key: str, invocation_metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The child's side: the proof for the call's challenge, or None when it carries none (or a bad one)."""
    challenge = _value(invocation_metadata, CHALLENGE_METADATA_KEY)
    if challenge is None or not 0 < len(challenge) <= MAX_CHALLENGE_CHARS or not challenge.isascii():
        return None
    return proof(launch_key, challenge)


def verify(launch_key: str, challenge: str, trailing_metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
    """The launcher's side: whether the reply's trailers carry the right proof (constant time)."""
    given = _value(trailing_metadata, PROOF_METADATA_KEY)
    return given is not None and hmac.compare_digest(given.encode(), proof(launch_key, challenge).encode())

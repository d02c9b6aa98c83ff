"""Secrets handed from ``epd up`` to a child on an inherited pipe, never in its environment.

A process's environment is copied into everything it starts (the proxy's
model-building child, compiler workers, a shell opened from it) and stays
readable in ``/proc/<pid>/environ`` for the whole life of the process. So
the launcher moves the secrets it hands a child (the internal token, the
child's launch key, its peers' keys) out of the child's environment into a
pipe whose read end the child inherits, named by ``$EPD_SECRETS_FD``. The
child reads the pipe once at start-up (``receive``, from
``security.from_args``) and closes it: from then on the secrets live only
in its memory, and nothing it starts inherits them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, MutableMapping

SECRETS_FD_ENV = "EPD_SECRETS_FD"
"""Environment variable naming the inherited descriptor the secrets are read from."""

MAX_BYTES = 60_000
"""Most bytes handed over: below a pipe's 64 KiB buffer, so writing them never blocks."""


def hand_over(env: MutableMapping[str, str], names: Iterable[str]) -> int | None:
    """Moves the ``names`` present in ``env`` (a child's environment) into a new pipe.

    ``env`` then names the pipe's read end instead. Returns that descriptor,
    for ``Popen(pass_fds=...)`` (the caller closes it once the child has
    started), or None when ``env`` held none of ``names``.
    """
    secrets = {name: env.pop(name) for name in names if name in env}
    if not secrets:
        return None
    data = json.dumps(secrets).encode()
    if len(data) > MAX_BYTES:
        raise ValueError(f"secrets for a child take {len(data)} bytes; at most {MAX_BYTES} fit the pipe")
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, data)  # one write of < 64 KiB into an empty pipe: complete, never blocking
    finally:
        os.close(write_fd)  # the child reads to end of file
    env[SECRETS_FD_ENV] = str(read_fd)
    return read_fd


def receive(environ: MutableMapping[str, str]) -> dict[str, str]:
    """The secrets on the pipe ``$EPD_SECRETS_FD`` names, read to its end and closed; {} without one.

    The variable is removed from ``environ`` (a descriptor number means
    nothing to a process this one starts). ValueError when the variable or
    what the pipe holds is not what ``hand_over`` made; never echoes either.
    """
    value = environ.pop(SECRETS_FD_ENV, None)
    if value is None:
        return {}
    if not value.isdigit():
        raise ValueError(f"${SECRETS_FD_ENV} is not a file descriptor")
    try:
        with os.fdopen(int(value), "rb") as pipe:
            data = pipe.read(MAX_BYTES + 1)
    except OSError:
        raise ValueError(f"${SECRETS_FD_ENV} names no readable descriptor") from None
    try:
        secrets = json.loads(data) if len(data) <= MAX_BYTES else None
    except ValueError:
        secrets = None
    if not isinstance(secrets, dict) or not all(isinstance(v, str) for v in secrets.values()):
        raise ValueError(f"the pipe ${SECRETS_FD_ENV} names does not hold secrets from epd up")
    return secrets

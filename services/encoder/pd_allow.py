"""Which PDs an ``Encode`` may name (``--pd-allow``): the encoder dials only those.

The allow-list itself is shared with PD's ``--decode-allow``: see
``services/common/dial_allow.py``.
"""

from __future__ import annotations

from services.common.dial_allow import (
    ANY,
    LOOPBACK_NAMES,
    PdAllowList,
    PdAllowSpec,
    Resolver,
    is_loopback,
    split_host_port,
    system_resolver,
)

__all__ = [
    "ANY",
    "LOOPBACK_NAMES",
    "PdAllowList",
    "PdAllowSpec",
    "Resolver",
    "is_loopback",
    "split_host_port",
    "system_resolver",
]

"""Test-only fault injection for the proxy (``epd proxy --fault ...``).

Off unless a fault is named. ``slow-decode-ms=N`` makes every image decode
sleep N ms first (a slow or hostile image, an overloaded preprocessing pool),
so tests drive the request deadline around preprocessing and check that
decoding stays off the event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.common.fault_spec import parse_fault_spec


@dataclass(frozen=True)
class ProxyFaults:
    """Which faults the proxy injects; the default injects none."""

    slow_decode_ms: int = 0

    def __post_init__(self) -> None:
        if self.slow_decode_ms < 0:
            raise ValueError("slow-decode-ms must be >= 0")

    @classmethod
    def parse(cls, spec: str) -> ProxyFaults:
        """``"slow-decode-ms=500"`` -> ``ProxyFaults``; ValueError names the bad part."""
        return cls(**parse_fault_spec(spec, integers={"slow-decode-ms": "slow_decode_ms"}))

    @property
    def enabled(self) -> bool:
        return self != ProxyFaults()

    def describe(self) -> str:
        """The spec string these faults parse from (for the start-up warning)."""
        return f"slow-decode-ms={self.slow_decode_ms}" if self.slow_decode_ms else ""

    def before_decode(self) -> None:
        """Called in the preprocessing worker before each image is decoded."""
        if self.slow_decode_ms:
            time.sleep(self.slow_decode_ms / 1000.0)


NO_FAULTS = ProxyFaults()

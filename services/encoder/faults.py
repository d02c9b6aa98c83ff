"""Test-only fault injection for the embedding hand-off (``epd encoder --fault ...``).

Off unless a fault is named. Each fault makes the pusher misbehave in one
specific way so that tests can drive PD's real rejection branches and the
proxy's failure paths against real servers:

- ``never-push``      Encode reports success but pushes nothing (PD's lease must end the request).
- ``push-late-ms=N``  wait N ms after encoding before pushing (a slow or stuck encoder).
- ``wrong-shape``     push one row fewer than PD reserved (FAILED_PRECONDITION on PD).
- ``wrong-dtype``     push the embedding as uint8 (PD accepts float dtypes only: INVALID_ARGUMENT).
- ``extra-chunk``     send one data chunk more than the header declared (FAILED_PRECONDITION).

Several faults may be combined with commas (``push-late-ms=200,extra-chunk``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.fault_spec import parse_fault_spec

if TYPE_CHECKING:  # imported where it is used: --help and config building need no torch
    import torch

EXTRA_CHUNK = b"\x00" * 8
"""The surplus payload ``extra-chunk`` appends after the declared bytes."""

_SWITCHES = {
    "never-push": "never_push",
    "wrong-shape": "wrong_shape",
    "wrong-dtype": "wrong_dtype",
    "extra-chunk": "extra_chunk",
}


@dataclass(frozen=True)
class Faults:
    """Which faults the pusher injects; the default injects none."""

    never_push: bool = False
    push_late_ms: int = 0
    wrong_shape: bool = False
    wrong_dtype: bool = False
    extra_chunk: bool = False

    def __post_init__(self) -> None:
        if self.push_late_ms < 0:
            raise ValueError("push-late-ms must be >= 0")

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """``"wrong-shape,push-late-ms=200"`` -> ``Faults``; ValueError names the bad part."""
        return cls(**parse_fault_spec(spec, switches=_SWITCHES, integers={"push-late-ms": "push_late_ms"}))

    @property
    def enabled(self) -> bool:
        return self != Faults()

    def describe(self) -> str:
        """The spec string these faults parse from (for the start-up warning)."""
        parts = [flag for flag, attr in _SWITCHES.items() if getattr(self, attr)]
        if self.push_late_ms:
            parts.append(f"push-late-ms={self.push_late_ms}")
        return ",".join(parts)

    def tamper(self, embedding: torch.Tensor) -> torch.Tensor:
        """The tensor actually pushed in place of ``embedding`` (``[num_tokens, ...]``)."""
        if self.wrong_shape:
            embedding = embedding[:-1]
        if self.wrong_dtype:
            import torch

            embedding = embedding.to(torch.uint8)
        return embedding

    def extra_chunks(self) -> tuple[bytes, ...]:
        """Data chunks sent after the declared payload."""
        return (EXTRA_CHUNK,) if self.extra_chunk else ()


NO_FAULTS = Faults()

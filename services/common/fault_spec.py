"""Parsing of the test-only ``--fault`` specs the encoder, PD and proxy take."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def parse_fault_spec(
    spec: str, *, switches: Mapping[str, str] = {}, integers: Mapping[str, str] = {}
) -> dict[str, Any]:
    """``"name,other=3"`` -> dataclass fields: a switch sets its field True, ``name=N`` sets it to N.

    The values are ``bool`` or ``int`` by field, so the dict is typed as the keyword arguments of
    the faults dataclass it is spread into.

    ``switches`` and ``integers`` map spec names to field names. ValueError
    names the part that is neither.
    """
    fields: dict[str, Any] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        if name in integers and sep:
            try:
                fields[integers[name]] = int(value)
            except ValueError:
                raise ValueError(f"{name} needs an integer") from None
        elif name in switches and not sep:
            fields[switches[name]] = True
        else:
            known = ", ".join([*switches, *(f"{flag}=N" for flag in integers)])
            raise ValueError(f"unknown fault {part!r}; known faults: {known}")
    return fields

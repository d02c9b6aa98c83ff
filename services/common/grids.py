"""``epd.v1.ImageGrid`` <-> ``(t, h, w)`` tuples, the one place both directions live."""

from __future__ import annotations

from services.common.pb import epd_pb2

Grid = tuple[int, int, int]


def grid_to_pb(grid: Grid | None) -> epd_pb2.ImageGrid | None:
    """The message form of ``grid`` (None stays None: the field is left unset)."""
    if grid is None:
        return None
    t, h, w = grid
    return epd_pb2.ImageGrid(t=t, h=h, w=w)


def grid_from_pb(item: epd_pb2.MultiModalItem | epd_pb2.EncodeItem) -> Grid | None:
    """The item's grid, or None when the field is absent (fixed-size images).

    Raises ValueError when a set grid has a zero dimension.
    """
    if not item.HasField("grid"):
        return None
    grid = (int(item.grid.t), int(item.grid.h), int(item.grid.w))
    if min(grid) <= 0:
        raise ValueError("grid dimensions must be positive")
    return grid

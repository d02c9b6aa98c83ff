"""Proto <-> domain conversion for the Encoder service, including input validation.

Validation errors name the field and item index only; they never echo
what the caller sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from services.common import hashing, tensors
from services.common.encode_items import ProcessFile, item_pixels
from services.common.models.vision_io import Grid, PixelLayout
from services.common.pb import epd_pb2
from services.common.video_files import NO_BUDGET, DecodeBudget
from services.encoder.errors import InvalidInput

MAX_ADDRESS_CHARS = 512


@dataclass(frozen=True)
class EncodeItemWork:
    """One validated image of an Encode call."""

    mm_hash: str
    reservation_id: str  # PD reservation to fill
    pixel_values: torch.Tensor  # floating point from the checkpoint's image processor: [3, H, W] or patches
    grid: Grid | None = None  # patch grid (t, h, w) of a dynamic-resolution image; pixel_values is [t*h*w, D]


@dataclass(frozen=True)
class EncodeWork:
    """A validated Encode call."""

    request_id: str
    pd_address: str  # host:port of the PD holding the reservations
    items: tuple[EncodeItemWork, ...]


@dataclass(frozen=True)
class ItemOutcome:
    """What happened to one item; becomes an ``EncodeItemResult``."""

    mm_hash: str
    cache_hit: bool
    encode_s: float  # vision forward time of its batch (0 on a hit)
    push_s: float  # time to push to PD, including waiting for outbound budget

    def to_pb(self) -> epd_pb2.EncodeItemResult:
        return epd_pb2.EncodeItemResult(
            mm_hash=self.mm_hash,
            cache_hit=self.cache_hit,
            encode_ms=self.encode_s * 1000.0,
            push_ms=self.push_s * 1000.0,
        )


def _check_id(value: str, what: str) -> str:
    if not value:
        raise InvalidInput(f"{what} is required")
    if len(value) > tensors.MAX_ID_CHARS or not value.isprintable():
        raise InvalidInput(f"{what} is too long or not printable")
    return value


def _parse_item(
    item: epd_pb2.EncodeItem,
    index: int,
    layout: PixelLayout,
    process_file: ProcessFile | None,
    cache_salt: str,
    accept_pixel_values: bool,
    budget: DecodeBudget,
) -> EncodeItemWork:
    mm_hash = _check_id(item.mm_hash, f"item {index}: mm_hash")
    reservation_id = _check_id(item.reservation_id, f"item {index}: reservation_id")
    try:
        pixels, grid = item_pixels(item, index, layout, process_file, cache_salt, accept_pixel_values, budget)
    except ValueError as error:
        raise InvalidInput(str(error)) from None
    return EncodeItemWork(mm_hash=mm_hash, reservation_id=reservation_id, pixel_values=pixels, grid=grid)


def check_pd_address(address: str) -> str:
    """``address`` if it is present and well formed (printable, no spaces, bounded); ``InvalidInput`` otherwise."""
    if not address:
        raise InvalidInput("pd_address is required")
    if len(address) > MAX_ADDRESS_CHARS or not address.isprintable() or any(c.isspace() for c in address):
        raise InvalidInput("pd_address is malformed")
    return address


def check_cache_salt(cache_salt: str) -> str:
    """The wire salt if well formed (``hashing.check_cache_salt``); ``InvalidInput`` otherwise."""
    try:
        return hashing.check_cache_salt(cache_salt)
    except ValueError as error:
        raise InvalidInput(str(error)) from None


def parse_encode_request(
    request: epd_pb2.EncodeRequest,
    layout: PixelLayout = PixelLayout(),
    process_file: ProcessFile | None = None,
    accept_pixel_values: bool = True,
    budget: DecodeBudget = NO_BUDGET,
) -> EncodeWork:
    """Validates an ``EncodeRequest`` against the vision module's ``layout``; raises ``InvalidInput``.

    ``process_file`` turns image files into pixels (None: pixel_values only);
    it decodes and processes images, so call this off the event loop.
    ``accept_pixel_values``: see ``EncoderConfig.accept_pixel_values``.
    ``budget``: when a video's decoding must stop (``DecodeStopped``).
    """
    request_id = _check_id(request.request_id, "request_id")
    address = check_pd_address(request.pd_address)
    cache_salt = check_cache_salt(request.cache_salt)
    if not request.items:
        raise InvalidInput("items must not be empty")
    items = tuple(
        _parse_item(item, index, layout, process_file, cache_salt, accept_pixel_values, budget)
        for index, item in enumerate(request.items)
    )
    return EncodeWork(request_id=request_id, pd_address=address, items=items)


def encode_response(outcomes: Iterable[ItemOutcome]) -> epd_pb2.EncodeResponse:
    """The reply of a successful Encode call, items in request order."""
    return epd_pb2.EncodeResponse(items=[outcome.to_pb() for outcome in outcomes])


def encoder_load(num_pending: int, cache_bytes: int, outbound_bytes: int) -> epd_pb2.EncoderLoad:
    """The reply of ``GetLoad``."""
    return epd_pb2.EncoderLoad(num_pending=num_pending, cache_bytes=cache_bytes, outbound_bytes=outbound_bytes)

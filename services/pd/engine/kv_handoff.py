"""The KV hand-off between a prefill and a decode instance: its bookkeeping. Pure Python.

Two steps, like the embeddings' Preallocate / PushEmbedding:

1. On the decode instance (D), ``ReserveKV`` takes KV blocks for a prompt
   under a lease (``KVReservations``). The prompt's cached prefix on D is
   looked up first: those leading blocks are shared, never sent.
2. The prefill instance (P) prefills, samples the first token, keeps the
   prompt's blocks held (``KVExports``) and pushes the blocks D lacks into
   the reservation (PushKV). The push names the first token: the
   reservation is then FILLED.
3. D's Generate, with the reservation id, takes the blocks over and the
   request decodes from its second token on, as if it had been prefilled here.

A reservation leaves the table when Generate takes it, when its request is
aborted, or when its lease runs out (its blocks are then freed, and its id
remembered, a bounded number of them, so a late push or Generate hears
DEADLINE_EXCEEDED). A push for an unknown reservation, another request's, a
filled one or blocks outside it is refused and writes nothing. Block ids
only: the runner moves the bytes.

Reservations hold decode slots and KV blocks before any Generate, so one
caller address may hold only a share of them (``ReservationLimits``): a
caller holding the internal token cannot take every slot or block and
leave every other request a RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import enum
import itertools
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.leases import LeaseQueue
from services.pd.engine.outputs import SampledToken
from services.pd.engine.request import Request

EXPIRED_MEMORY = 4096
"""Reservation ids whose lease ran out, remembered for a late push or Generate (bounded)."""
DEFAULT_MAX_SHARE_PER_PEER = 0.5
"""Share of the decode slots, and of the KV blocks, one caller's reservations may hold (``--max-kv-reservation-share``)."""


@dataclass(frozen=True)
class ReservationLimits:
    """How much of a decode instance the live reservations of one caller address may hold.

    ``max_share_per_peer`` of the decode slots (``max_num_seqs``; at least one reservation) and of
    the KV blocks; a caller's only reservation may take more blocks (a long prompt stays servable).
    """

    max_share_per_peer: float = DEFAULT_MAX_SHARE_PER_PEER

    def __post_init__(self) -> None:
        if not 0 < self.max_share_per_peer <= 1:
            raise ValueError("the KV reservation share per caller must be in (0, 1]")

    def max_reservations(self, max_num_seqs: int) -> int:
        return max(1, int(self.max_share_per_peer * max_num_seqs))

    def max_blocks(self, num_blocks: int) -> int:
        return int(self.max_share_per_peer * num_blocks)


class Role(enum.Enum):
    """What an engine serves: both halves of a request, or one side of a KV hand-off."""

    BOTH = "both"  # prefill and decode here; may also act as either side of a hand-off
    PREFILL = "prefill"  # prefills and samples the first token, then pushes the KV to a decode instance
    DECODE = "decode"  # admits requests whose KV came over the wire, then decodes them

    @property
    def decodes(self) -> bool:
        """Whether it accepts KV reservations and pushes."""
        return self is not Role.PREFILL

    @property
    def prefills(self) -> bool:
        """Whether it runs prompts (a hand-off's first half, or a whole request)."""
        return self is not Role.DECODE


class ReservationState(enum.IntEnum):
    """A KV reservation's life on D. Ordered: a push is wanted only while RESERVED."""

    RESERVED = 0  # blocks held, waiting for P's push
    FILLED = 1  # every block D lacked was written; the first token is known


@dataclass(frozen=True)
class KVGrant:
    """ReserveKV's answer: where P pushes, and what it skips."""

    reservation_id: str
    num_blocks: int  # blocks of the prompt's K/V (tokens 0 .. num_prompt_tokens - 1)
    num_cached_blocks: int  # leading blocks D already holds (prefix cache): never sent
    block_size: int


@dataclass
class KVReservation:
    """One live reservation. ``probe`` carries the prompt and owns the reserved blocks (its block table)."""

    reservation_id: str
    probe: Request
    deadline: float  # monotonic seconds
    num_cached_blocks: int
    peer: str = ""  # the caller address that reserved it (its share is bounded)
    state: ReservationState = ReservationState.RESERVED
    first_token: SampledToken | None = None  # P's sample, with its logprobs when asked for

    def matches(self, request: Request) -> bool:
        """Whether ``request`` is the prompt this reservation was made for (its K/V is this prompt's)."""
        probe = self.probe
        return (
            request.prompt_token_ids == probe.prompt_token_ids
            and request.mm_spans == probe.mm_spans
            and request.cache_salt == probe.cache_salt
        )


class KVReservations:
    """Live reservations by id and by request id, their leases, and the ids that expired. Not thread-safe."""

    def __init__(self) -> None:
        self._live: dict[str, KVReservation] = {}
        self._by_request: dict[str, str] = {}
        self._per_peer: dict[str, tuple[int, int]] = {}  # caller address -> (reservations, blocks) held
        self._leases = LeaseQueue()
        self._expired: OrderedDict[str, None] = OrderedDict()
        # Per instance, so a restarted D never matches an id handed out before.
        self._prefix = f"kvres-{uuid.uuid4().hex[:12]}"
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[KVReservation]:
        return iter(list(self._live.values()))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._by_request

    def held_by(self, peer: str) -> tuple[int, int]:
        """``(reservations, blocks)`` the live reservations of ``peer`` hold."""
        return self._per_peer.get(peer, (0, 0))

    def add(self, probe: Request, deadline: float, num_cached_blocks: int, peer: str = "") -> KVReservation:
        """Records a reservation whose blocks ``probe`` already holds, counted against ``peer``."""
        reservation = KVReservation(f"{self._prefix}-{next(self._ids)}", probe, deadline, num_cached_blocks, peer)
        self._live[reservation.reservation_id] = reservation
        self._by_request[probe.request_id] = reservation.reservation_id
        self._leases.push(deadline, reservation.reservation_id)
        count, blocks = self.held_by(peer)
        self._per_peer[peer] = (count + 1, blocks + len(probe.block_ids))
        return reservation

    def lookup(self, request_id: str, reservation_id: str, now: float) -> KVReservation:
        """The live reservation ``reservation_id`` of ``request_id``; raises EngineError otherwise."""
        reservation = self._live.get(reservation_id)
        if reservation is None or reservation.deadline < now:
            if reservation is not None or reservation_id in self._expired:
                raise EngineError(ErrorKind.DEADLINE_EXCEEDED, "the KV reservation's lease expired")
            raise EngineError(ErrorKind.NOT_FOUND, "unknown KV reservation")
        if reservation.probe.request_id != request_id:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "the KV reservation belongs to another request")
        return reservation

    def blocks_to_fill(self, request_id: str, reservation_id: str, num_blocks: int, now: float) -> list[int]:
        """The block ids a push of ``num_blocks`` blocks writes (those after the cached ones); refuses
        a push to a reservation not RESERVED or of another size, changing nothing."""
        reservation = self.lookup(request_id, reservation_id, now)
        if reservation.state is not ReservationState.RESERVED:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "the KV reservation is already filled")
        block_ids = reservation.probe.block_ids[reservation.num_cached_blocks :]
        if num_blocks != len(block_ids):
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "the KV push does not match the reservation's blocks")
        return list(block_ids)

    def fill(self, request_id: str, reservation_id: str, first_token: SampledToken, now: float) -> None:
        """Marks a reservation FILLED (its blocks were written) with the first token P sampled."""
        reservation = self.lookup(request_id, reservation_id, now)
        if reservation.state is not ReservationState.RESERVED:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "the KV reservation is already filled")
        reservation.state = ReservationState.FILLED
        reservation.first_token = first_token

    def take(self, request_id: str, reservation_id: str, now: float) -> KVReservation:
        """Removes and returns a FILLED reservation for its Generate; raises EngineError, changing nothing."""
        reservation = self.lookup(request_id, reservation_id, now)
        if reservation.state is not ReservationState.FILLED:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "the KV reservation has not been filled")
        self._remove(reservation)
        return reservation

    def pop_request(self, request_id: str) -> KVReservation | None:
        """Removes the reservation of ``request_id`` (its abort); None when it has none."""
        reservation_id = self._by_request.get(request_id)
        reservation = self._live.get(reservation_id) if reservation_id is not None else None
        if reservation is not None:
            self._remove(reservation)
        return reservation

    def expire(self, now: float) -> list[KVReservation]:
        """Removes and returns the reservations whose lease ended before ``now``; remembers their ids."""

        def is_live(reservation_id: str, deadline: float) -> bool:
            reservation = self._live.get(reservation_id)
            return reservation is not None and reservation.deadline == deadline

        ended = [self._live[r] for r in self._leases.pop_ended(now, is_live)]
        for reservation in ended:
            self._remove(reservation)
            self._expired[reservation.reservation_id] = None
        while len(self._expired) > EXPIRED_MEMORY:
            self._expired.popitem(last=False)
        return ended

    def _remove(self, reservation: KVReservation) -> None:
        del self._live[reservation.reservation_id]
        del self._by_request[reservation.probe.request_id]
        count, blocks = self._per_peer[reservation.peer]
        if count > 1:  # its blocks: the probe's table, unchanged since ``add``
            self._per_peer[reservation.peer] = (count - 1, blocks - len(reservation.probe.block_ids))
        else:
            del self._per_peer[reservation.peer]


@dataclass(frozen=True)
class KVExport:
    """A finished prefill's K/V, held on P until its push to D lands (or its lease runs out)."""

    request_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks, in order
    num_tokens: int  # prompt tokens whose K/V they hold
    first_token_id: int
    deadline: float


class KVExports:
    """P's held exports by request id, with leases: a push that never ends cannot pin blocks forever."""

    def __init__(self) -> None:
        self._live: dict[str, KVExport] = {}
        self._leases = LeaseQueue()

    def __len__(self) -> int:
        return len(self._live)

    def add(self, export: KVExport) -> None:
        self._live[export.request_id] = export
        self._leases.push(export.deadline, export.request_id)

    def get(self, request_id: str) -> KVExport | None:
        return self._live.get(request_id)

    def pop(self, request_id: str) -> KVExport | None:
        return self._live.pop(request_id, None)

    def expire(self, now: float) -> list[KVExport]:
        """Removes and returns the exports whose lease ended before ``now``."""

        def is_live(request_id: str, deadline: float) -> bool:
            export = self._live.get(request_id)
            return export is not None and export.deadline == deadline

        return [self._live.pop(r) for r in self._leases.pop_ended(now, is_live)]

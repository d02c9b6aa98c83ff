"""The engine core's two sides of a KV hand-off (``kv_handoff.py``): one EngineCore, with a role.

``EngineCore`` inherits this mixin; ``core.py`` calls three hooks from its own
lifecycle: ``_hold_export`` (a hand-off request's release keeps its prompt
blocks), ``_release_handoff`` (every release) and ``_expire_handoffs``
(every sweep). Pure Python: the servicer moves the bytes through the runner.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.kv_handoff import (
    KVExport,
    KVExports,
    KVGrant,
    KVReservations,
    ReservationLimits,
    ReservationState,
    Role,
)
from services.pd.engine.outputs import SampledToken
from services.pd.engine.request import MultiModalSpan, Request, RequestStatus, SamplingParams
from services.pd.engine.scheduler_config import QueueFull, validate_request

if TYPE_CHECKING:
    from services.pd.engine.kv_cache import KVCacheManager
    from services.pd.engine.scheduler import Scheduler
    from services.pd.engine.streams import RequestStreams

_EXPORT_OWNER = "kv-export\x00"  # prefixes a request id: never a request id itself
_HANDED_OVER = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class KVHandoffMixin:
    """ReserveKV / PushKV bookkeeping on the decode side, held exports on the prefill side."""

    role: Role
    kv_cache: KVCacheManager
    scheduler: Scheduler
    export_lease_s: float
    _streams: RequestStreams
    _clock: Callable[[], float]
    _reservations: KVReservations
    _reservation_limits: ReservationLimits
    _exports: KVExports
    _num_expired_kv_reservations: int

    if TYPE_CHECKING:

        def _finish(self, request_id: str, request: Request | None, error: EngineError | None) -> None: ...

    def _init_handoff(self, role: Role, export_lease_s: float, limits: ReservationLimits | None = None) -> None:
        self.role = role
        self.export_lease_s = export_lease_s  # how long P holds a finished prefill's K/V for its push
        self._reservations = KVReservations()  # decode side: blocks reserved for a push
        self._reservation_limits = limits or ReservationLimits()
        self._exports = KVExports()  # prefill side: blocks held until their push lands
        self._num_expired_kv_reservations = 0

    # ------------------------------------------------------------ decode side
    def reserve_kv(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        spans: Sequence[MultiModalSpan],
        lease_s: float,
        cache_salt: str = "",
        peer: str = "",
    ) -> KVGrant:
        """Takes blocks for a prompt's K/V under a lease; its cached prefix here is shared, not pushed.

        Raises EngineError, holding nothing: FAILED_PRECONDITION on a prefill-only
        engine, ALREADY_EXISTS, INVALID_ARGUMENT, RESOURCE_EXHAUSTED (no slot or no blocks,
        or ``peer``, the caller's address, holds its share of them: ``ReservationLimits``).
        """
        if not self.role.decodes:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "this instance does not decode handed-off requests")
        if request_id in self._streams or self._reservations.has_request(request_id):
            raise EngineError(ErrorKind.ALREADY_EXISTS, "a request with this id is already running")
        probe = Request(
            request_id, list(prompt_token_ids), SamplingParams(max_tokens=1), list(spans), cache_salt=cache_salt
        )
        try:
            validate_request(probe, self.scheduler.config, self.kv_cache.num_blocks_for, self.kv_cache.num_blocks)
        except ValueError as exc:
            raise EngineError(ErrorKind.INVALID_ARGUMENT, str(exc)) from None  # our own message
        retry_s = self.scheduler.config.retry_after_s
        if self.scheduler.num_active + len(self._reservations) >= self.scheduler.config.max_num_seqs:
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "no free decode slot", retry_s)
        held, held_blocks = self._reservations.held_by(peer)
        limits = self._reservation_limits
        if held >= limits.max_reservations(self.scheduler.config.max_num_seqs):
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "too many KV reservations from this caller", retry_s)
        num_blocks = self.kv_cache.num_blocks_for(probe.num_prompt_tokens)
        if held and held_blocks + num_blocks > limits.max_blocks(self.kv_cache.num_blocks):
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "this caller's KV reservations hold their share", retry_s)
        prefix = self.kv_cache.claim_cached_prefix(probe)
        probe.cached_prefix = None
        if not self.kv_cache.allocate_slots(probe, probe.num_prompt_tokens - prefix.num_tokens, prefix.block_ids):
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "no free KV blocks", retry_s)
        probe.num_cached_tokens = prefix.num_tokens
        reservation = self._reservations.add(probe, self._clock() + lease_s, len(prefix.block_ids), peer)
        return KVGrant(
            reservation.reservation_id, len(probe.block_ids), reservation.num_cached_blocks, self.kv_cache.block_size
        )

    def kv_push_targets(self, request_id: str, reservation_id: str, num_blocks: int) -> list[int]:
        """The block ids a push of ``num_blocks`` blocks writes; refuses (EngineError) a push not wanted."""
        return self._reservations.blocks_to_fill(request_id, reservation_id, num_blocks, self._clock())

    def fill_kv(self, request_id: str, reservation_id: str, first_token: SampledToken | int) -> None:
        """Records that a push's blocks were written and the first token P sampled (with its logprobs)."""
        sampled = first_token if isinstance(first_token, SampledToken) else SampledToken(first_token)
        self._reservations.fill(request_id, reservation_id, sampled, self._clock())

    def add_handed_off(self, request: Request, reservation_id: str) -> None:
        """Admits a Generate whose prompt K/V and first token came from P; it decodes from its second token.

        Raises EngineError, holding nothing: a Generate that does not fit its reservation (another prompt,
        not filled yet, a first token its grammar refuses) leaves the reservation for the right one; a
        refusal at admission (no slot) frees it.
        """
        if request.request_id in self._streams:
            raise EngineError(ErrorKind.ALREADY_EXISTS, "a request with this id is already running")
        first = self._take_reservation(request, reservation_id)
        token_id = first.token_id
        try:
            self.scheduler.add_request(request, computed=True)
        except (ValueError, QueueFull) as exc:
            self.kv_cache.free(request)
            if isinstance(exc, QueueFull):
                raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "no free decode slot", exc.retry_after_s) from None
            raise EngineError(ErrorKind.INVALID_ARGUMENT, str(exc)) from None
        request.timings.first_scheduled = request.timings.first_token = self._clock()
        self.kv_cache.cache_full_blocks(request)  # the pushed blocks, under the request's private keys
        self._streams.open(request)
        status = request.stop_status(token_id, self.scheduler.config.max_model_len)
        if status is not None:
            self.scheduler.finish_request(request.request_id, status)
        stopped = self._streams.add_token(request, first)
        if stopped and not request.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:  # its first token ended it
            self._finish(request.request_id, request, None)

    def _take_reservation(self, request: Request, reservation_id: str) -> SampledToken:
        """Moves a FILLED reservation's blocks and first token onto ``request``; returns the first token."""
        now = self._clock()
        reservation = self._reservations.lookup(request.request_id, reservation_id, now)
        if not reservation.matches(request):
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "the prompt differs from the KV reservation's")
        first = reservation.first_token
        if reservation.state is not ReservationState.FILLED or first is None:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "the KV reservation has not been filled")
        # P's matcher accepted the first token; this request's own one must have too before it samples.
        if request.grammar is not None and not request.grammar.accept(first.token_id):
            raise EngineError(ErrorKind.FAILED_PRECONDITION, "the first token breaks the request's grammar")
        taken = self._reservations.take(request.request_id, reservation_id, now)
        probe = taken.probe
        request.block_ids, probe.block_ids = probe.block_ids, []
        # The blocks D had cached keep their keys; the pushed ones are keyed for this request alone: a
        # caller holding the token could push any K/V, which no other request may be served from.
        request.block_hashes = probe.block_hashes[: taken.num_cached_blocks]
        request.private_kv_salt = secrets.token_bytes(16)
        request.private_kv_from = taken.num_cached_blocks
        request.num_computed_tokens = probe.num_prompt_tokens
        request.num_cached_tokens = probe.num_cached_tokens
        request.output_token_ids.append(first.token_id)
        return first

    # ----------------------------------------------------------- prefill side
    def _hold_export(self, request: Request) -> None:
        """Keeps a finished hand-off request's prompt blocks for its push (before its release frees them)."""
        if not request.hand_off_kv or request.status not in _HANDED_OVER or not request.output_token_ids:
            return
        if not request.block_ids or self._exports.get(request.request_id) is not None:  # a second release
            return
        num_tokens = request.num_prompt_tokens
        block_ids = tuple(request.block_ids[: self.kv_cache.num_blocks_for(num_tokens)])
        self.kv_cache.hold(_EXPORT_OWNER + request.request_id, block_ids)
        deadline = self._clock() + self.export_lease_s
        self._exports.add(KVExport(request.request_id, block_ids, num_tokens, request.output_token_ids[0], deadline))

    def take_export(self, request_id: str) -> KVExport | None:
        """The held K/V of a finished hand-off request (None: it ended otherwise, or its lease ran out)."""
        return self._exports.get(request_id)

    def release_export(self, request_id: str) -> None:
        """Lets go of a request's held K/V once its push landed or failed. Idempotent."""
        if self._exports.pop(request_id) is not None:
            self.kv_cache.unpin(_EXPORT_OWNER + request_id)

    # ------------------------------------------------------------------ hooks
    def _release_handoff(self, request_id: str) -> None:
        """Frees a reservation of ``request_id`` (abort, error). Not its export: the push owns that.

        A reservation past its lease that the sweep has not reached yet (its late push was refused,
        then the proxy aborted it) counts as expired, as it would have a sweep earlier.
        """
        reservation = self._reservations.pop_request(request_id)
        if reservation is not None:
            self.kv_cache.free(reservation.probe)
            if reservation.deadline < self._clock():
                self._num_expired_kv_reservations += 1

    def _expire_handoffs(self, now: float) -> None:
        for reservation in self._reservations.expire(now):
            self.kv_cache.free(reservation.probe)
            self._num_expired_kv_reservations += 1
        for export in self._exports.expire(now):
            self.kv_cache.unpin(_EXPORT_OWNER + export.request_id)

    def handoff_probes(self) -> list[Request]:
        """The requests-to-be holding reserved blocks (for ``check_integrity``)."""
        return [reservation.probe for reservation in self._reservations]

    def handoff_stats(self) -> dict[str, int]:
        """The hand-off's ``EngineStats`` fields."""
        return {
            "num_kv_reservations": len(self._reservations),
            "num_kv_exports": len(self._exports),
            "num_expired_kv_reservations": self._num_expired_kv_reservations,
        }

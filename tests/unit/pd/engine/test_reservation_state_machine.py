"""The reservation protocol as a state machine (hypothesis), on PD's real engine core.

The rules call the real ``EngineCore`` (Preallocate, Generate, abort, the
lease sweep, steps) over its real caches and scheduler, with an injected
clock and no engine thread. Pushes go through the real ``PushEmbedding``
servicer (header + chunks), so partial, oversized and header-less payloads
are assembled (and refused) where they are in production. Every push carries
distinct contents (its rows hold a unique tag), so the runner double can tell
exactly which push each computed image came from.

A small model of the protocol predicts each push's fate and the reserved
rows; after every step the invariants below must hold.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import grpc
import torch
from core_support import FakeClock, RunnerDouble, make_core
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from reservation_push_support import PUSH_MODES, PushClient

from services.pd.engine.embedding_records import EntryState
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.outputs import Failed, Finished
from services.pd.engine.request import MultiModalSpan, Request, RequestStatus, SamplingParams

IMG, HIDDEN, LEASE_S, CAPACITY = 0, 4, 10.0, 24
SIZES = {"img-a": 4, "img-b": 6, "img-c": 8, "img-d": 12}  # 30 rows > CAPACITY: eviction and refusals
S = grpc.StatusCode


SERVED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@dataclass
class ModelReservation:
    """What the protocol says about one reservation id handed out by Preallocate."""

    request_id: str
    mm_hash: str
    kind: str  # "push" | "pin" (embedding cache) | "kvpin" (prefix-cached KV)
    deadline: float
    filled: bool = False
    ended: bool = False
    end_on_fill: bool = False
    served: bool = False  # ended unfilled, served by another push or its request answered: a late push is a repeat


def prompt_of(images: list[str]) -> tuple[list[int], list[MultiModalSpan]]:
    """[1, 2] + per image: its placeholder rows + one text token; identical image lists share a prefix."""
    tokens, spans = [1, 2], []
    for mm_hash in images:
        spans.append(MultiModalSpan(mm_hash, len(tokens), SIZES[mm_hash]))
        tokens += [IMG] * SIZES[mm_hash] + [3]
    return tokens, spans


class ReservationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(100.0)
        runner = RunnerDouble()
        runner.on_step = self._check_step
        self.core = make_core(
            clock=self.clock,
            num_blocks=24,
            block_size=4,
            embedding_tokens=CAPACITY,
            runner=runner,
            hidden_size=HIDDEN,
            max_model_len=64,
            max_num_batched_tokens=10,
            max_num_seqs=3,
            max_waiting_requests=4,
        )
        self.kv, self.emb = self.core.kv_cache, self.core.embedding_cache
        self.store: dict[str, torch.Tensor] = self.core._embeddings  # white-box: the core's tensors
        self.pusher = PushClient(self.core)
        self.ids = itertools.count()
        self.tags = itertools.count(1)
        self.reservations: dict[str, ModelReservation] = {}
        self.preallocated: dict[str, list[str]] = {}  # request id -> images, not yet generating
        self.generating: dict[str, Request] = {}
        self.accepted: dict[str, float] = {}  # mm_hash -> tag of the push that made it READY
        self.num_computed_images = 0

    def _evicted(self, mm_hash: str) -> None:
        """A Preallocate evicted this READY entry (its tensor is gone from the store)."""
        open_ = [r for r in self.reservations.values() if r.mm_hash == mm_hash and r.kind != "kvpin" and not r.ended]
        assert not open_, "evicted an entry that a reservation still holds"
        self.accepted.pop(mm_hash)

    # --------------------------------------------------------------- model
    def _live_push(self, reservation: ModelReservation) -> bool:
        return (
            reservation.kind == "push"
            and not reservation.ended
            and not reservation.filled
            and self.clock.now <= reservation.deadline
        )

    def _sync_dropped_entries(self) -> None:
        """A RESERVED entry whose last pending push ended is gone, with all its reservations."""
        for mm_hash in SIZES:
            pending = [
                r
                for r in self.reservations.values()
                if r.mm_hash == mm_hash and r.kind == "push" and not r.ended and not r.filled
            ]
            if mm_hash not in self.accepted and not pending:
                for r in self.reservations.values():
                    if r.mm_hash == mm_hash and r.kind == "push":
                        r.ended = True

    def _model_cancel(self, request_id: str, served: bool = False) -> None:
        """The core's release of a request that ended: the last pending push of an entry others hold stays;
        ``served`` (it finished with its answer): its other unfilled pushes end, and a late one is taken as moot."""
        for r in self.reservations.values():
            if r.request_id != request_id or r.ended:
                continue
            pending = [
                o
                for o in self.reservations.values()
                if o.mm_hash == r.mm_hash and o.kind == "push" and not o.ended and not o.filled
            ]
            if (
                r.kind == "push"
                and not r.filled
                and r.mm_hash not in self.accepted
                and self.emb.ref_count(r.mm_hash) > 0
                and pending == [r]
            ):
                r.end_on_fill = True
            else:
                # served by another request's push (its entry READY), or its request finished with its answer
                by_another = r.end_on_fill and r.mm_hash in self.accepted
                r.served = r.kind == "push" and not r.filled and (by_another or served)
                r.ended = True
        self._sync_dropped_entries()

    # --------------------------------------------------------------- rules
    @rule(images=st.lists(st.sampled_from(sorted(SIZES)), min_size=1, max_size=2))
    def preallocate(self, images):
        request_id = f"r{next(self.ids)}"
        prompt, spans = prompt_of(images)
        before = (self.emb.stats(), self.kv.num_pinned_blocks, self.core.stats().num_kv_leases)
        stored = set(self.store)
        try:
            allocations = self.core.preallocate(request_id, spans, LEASE_S, prompt)
        except EngineError as error:
            assert error.kind in (ErrorKind.RESOURCE_EXHAUSTED, ErrorKind.INVALID_ARGUMENT)
            if error.kind is ErrorKind.RESOURCE_EXHAUSTED:
                assert error.retry_after_s
            after = (self.emb.stats(), self.kv.num_pinned_blocks, self.core.stats().num_kv_leases)
            assert after == before, "a refused Preallocate changed something"
            return
        for mm_hash in sorted(stored - set(self.store)):
            self._evicted(mm_hash)
        self.preallocated[request_id] = images
        for allocation, span in zip(allocations, spans):
            assert allocation.mm_hash == span.mm_hash
            known = self.reservations.get(allocation.reservation_id)
            if known is not None:  # the same image twice in one request: one reservation
                assert known.request_id == request_id and known.mm_hash == span.mm_hash
                continue
            kind = "kvpin" if allocation.via_prefix_cache else "pin" if allocation.ready else "push"
            if kind == "pin":
                assert span.mm_hash in self.accepted, "READY for an image no complete push delivered"
            if kind == "push":
                assert span.mm_hash not in self.accepted and span.mm_hash not in self.store
            self.reservations[allocation.reservation_id] = ModelReservation(
                request_id, span.mm_hash, kind, self.clock.now + LEASE_S
            )

    def _live_ids(self) -> list[str]:
        return sorted(rid for rid, r in self.reservations.items() if self._live_push(r))

    @precondition(lambda self: self._live_ids())
    @rule(data=st.data())
    def push_live(self, data):
        """The encoder's normal push: complete, to a reservation the protocol says is live."""
        reservation_id = data.draw(st.sampled_from(self._live_ids()))
        self._push_and_check(reservation_id, self.reservations[reservation_id], "complete")

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), mode=st.sampled_from(PUSH_MODES))
    def push_any(self, data, mode):
        """Any push to any reservation ever handed out (live, filled, expired, cancelled, re-assigned, pins)."""
        reservation_id = data.draw(st.sampled_from(sorted(self.reservations)))
        self._push_and_check(reservation_id, self.reservations[reservation_id], mode)

    @precondition(lambda self: len(self._live_ids()) < len(self.reservations))
    @rule(data=st.data())
    def late_push(self, data):
        """A complete push that arrives too late: expired (swept or not), cancelled, filled, re-assigned, a pin."""
        late = sorted(rid for rid, r in self.reservations.items() if not self._live_push(r))
        reservation_id = data.draw(st.sampled_from(late))
        self._push_and_check(reservation_id, self.reservations[reservation_id], "complete")

    def _push_and_check(self, reservation_id: str, reservation: ModelReservation, mode: str) -> None:
        tag = float(next(self.tags))
        code = self.pusher.push(
            reservation.request_id, reservation_id, reservation.mm_hash, SIZES[reservation.mm_hash], mode, tag
        )
        # a retried Encode pushing again, or a push its request, already served, no longer needs
        repeat = reservation.kind == "push" and (reservation.filled or reservation.served)
        if mode == "unknown_id":
            assert code is S.NOT_FOUND
        elif mode == "complete" and (self._live_push(reservation) or repeat):
            assert code is None, f"a complete push to a live (or filled) reservation was refused: {code}"
        else:
            assert code is not None, f"a push the protocol refuses was accepted ({mode}, {reservation})"
        if code is None and not repeat:  # a repeat changes nothing
            reservation.filled = True
            if reservation.mm_hash not in self.accepted:
                self.accepted[reservation.mm_hash] = tag
            if reservation.end_on_fill:
                reservation.ended = True

    @rule(data=st.data(), fresh=st.integers(0, 3))
    def generate(self, data, fresh):
        """Generate for a preallocated request, or (1 in 4) for one that never preallocated."""
        if self.preallocated and fresh < 3:
            request_id = data.draw(st.sampled_from(sorted(self.preallocated)))
            self._generate(request_id, self.preallocated.pop(request_id), preallocated=True)
        else:
            images = data.draw(st.lists(st.sampled_from(sorted(SIZES)), max_size=2))
            self._generate(f"g{next(self.ids)}", images, preallocated=False)

    def _generate(self, request_id: str, images: list[str], preallocated: bool) -> None:
        """``EngineCore.add_request``: take over, then queue (giving everything back if refused)."""
        prompt, spans = prompt_of(images)
        request = Request(request_id, prompt, SamplingParams(max_tokens=2), mm_spans=spans)
        try:
            self.core.add_request(request)
        except EngineError as error:
            # A lease that ran out reads as a timeout; a request that never preallocated, as a protocol error;
            # a full waiting queue as a retry hint.
            allowed = (
                {ErrorKind.FAILED_PRECONDITION, ErrorKind.DEADLINE_EXCEEDED}
                if preallocated
                else {ErrorKind.FAILED_PRECONDITION}
            )
            assert error.kind in allowed | {ErrorKind.RESOURCE_EXHAUSTED}
            if error.kind is ErrorKind.RESOURCE_EXHAUSTED:
                self._model_take_over(request_id)
            self._model_cancel(request_id)
            return
        self._model_take_over(request_id)
        self.generating[request_id] = request

    def _model_take_over(self, request_id: str) -> None:
        """Generate took the request's reservations over: pushes still due end when filled."""
        for r in self.reservations.values():
            if r.request_id == request_id and not r.ended:
                if r.kind == "push" and not r.filled:
                    r.end_on_fill = True
                else:
                    r.ended = True

    @precondition(lambda self: self.preallocated or self.generating)
    @rule(data=st.data())
    def abort(self, data):
        """``EngineCore.abort`` (client gone, deadline, proxy Abort)."""
        request_id = data.draw(st.sampled_from(sorted([*self.preallocated, *self.generating])))
        self.preallocated.pop(request_id, None)
        self.generating.pop(request_id, None)
        self.core.abort(request_id)
        self._model_cancel(request_id)

    @rule(seconds=st.sampled_from([1.0, 4.0, 11.0]))
    def advance_clock(self, seconds):
        self.clock.now += seconds

    @rule()
    def sweep(self):
        """``EngineCore.sweep``: end leases, fail the requests that waited on a dropped entry."""
        now = self.clock.now
        for r in self.reservations.values():
            if not r.ended and r.deadline < now:
                r.ended = True
        self._sync_dropped_entries()
        reserved = {h for h in SIZES if self.emb.state(h) is EntryState.RESERVED}
        self.core.sweep()
        for mm_hash in reserved:
            if self.emb.state(mm_hash) is None:
                assert mm_hash not in self.accepted, "a READY entry was dropped by a lease"
        for request_id in [r for r in self.generating if self.core.scheduler.get_request(r) is None]:
            del self.generating[request_id]  # failed: an image it waited on is gone
            self._model_cancel(request_id)

    @precondition(lambda self: self.generating)
    @rule(num_steps=st.integers(1, 3))
    def step(self, num_steps):
        for _ in range(num_steps):
            self._step()

    def _step(self) -> None:
        self.sweep()  # a step sweeps leases first when a sweep is due; the clock moves in whole seconds
        for request_id, event in self.core.step().events:
            if not isinstance(event, Finished | Failed):
                continue
            self.generating.pop(request_id, None)
            served = isinstance(event, Finished) and event.status in SERVED
            self._model_cancel(request_id, served)  # the core's release cancels what is left

    def _check_step(self, out, embeddings) -> None:
        for chunk in out.chunks:
            for piece in chunk.image_slices:
                self._check_computed_image(embeddings, piece.mm_hash, piece.src_start, piece.length)

    def _check_computed_image(self, embeddings, mm_hash: str, start: int, length: int) -> None:
        """The runner double: the rows it splices come from the one complete push accepted for the entry."""
        tensor = embeddings.get(mm_hash)
        assert tensor is not None, "scheduled an image whose embedding is not stored"
        assert mm_hash in self.accepted
        rows = tensor[start : start + length]
        assert rows.shape == (length, HIDDEN) and bool((rows == self.accepted[mm_hash]).all())
        self.num_computed_images += 1

    # ----------------------------------------------------------- invariants
    @invariant()
    def bookkeeping_is_consistent(self):
        self.core.check_integrity()
        stats = self.emb.stats()
        assert stats.used_tokens <= CAPACITY
        ready = {h for h in SIZES if self.emb.state(h) is EntryState.READY}
        assert set(self.store) == ready == set(self.accepted)
        for mm_hash, tensor in self.store.items():
            assert bool((tensor == self.accepted[mm_hash]).all()), "stored rows are not the accepted push"
        pending = {r.mm_hash for r in self.reservations.values() if r.kind == "push" and not r.ended and not r.filled}
        reserved = {h for h in SIZES if self.emb.state(h) is EntryState.RESERVED}
        assert reserved == pending - ready
        assert stats.reserved_tokens == sum(SIZES[h] for h in reserved)
        open_ids = {rid for rid, r in self.reservations.items() if r.kind != "kvpin" and not r.ended}
        assert stats.num_reservations == len(open_ids)
        kv_leases = {r.request_id for r in self.reservations.values() if r.kind == "kvpin" and not r.ended}
        assert self.core.stats().num_kv_leases == len(kv_leases)

    def teardown(self):
        try:
            for request_id in [*self.preallocated, *self.generating]:
                self.core.abort(request_id)
            self.clock.now += LEASE_S + 1
            self.core.sweep()
            self.core.step()
            self.core.check_integrity()
            stats = self.emb.stats()
            assert stats.reserved_tokens == stats.num_reservations == 0
            assert stats.ready_tokens == stats.evictable_tokens, "a reference outlived its request"
            assert self.kv.num_pinned_blocks == 0 and self.core.stats().num_kv_leases == 0
            assert self.kv.num_free_blocks == self.kv.num_blocks
        finally:
            self.pusher.close()


ReservationMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_reservation_protocol = ReservationMachine.TestCase


def test_the_machine_reaches_computed_images():
    """Guards the property test against vacuity: a plain run pushes, computes and checks images."""
    machine = ReservationMachine()
    try:
        machine.preallocate(["img-a"])
        [reservation_id] = machine.reservations
        machine.push_live(_Draw(reservation_id))
        machine.generate(_Draw("r0"), fresh=1)
        for _ in range(4):
            machine.step(1)
            machine.bookkeeping_is_consistent()
        assert machine.num_computed_images == 1 and not machine.generating
    finally:
        machine.teardown()


class _Draw:
    """Stands in for hypothesis's ``data`` when a rule is called by hand: draws the given value."""

    def __init__(self, value) -> None:
        self.value = value

    def draw(self, strategy):
        return self.value


def test_preallocate_is_refused_while_the_waiting_queue_is_full():
    """No room is reserved, so no encoder work is spent, for a request Generate would refuse."""
    machine = ReservationMachine()
    try:
        for _ in range(4):  # max_waiting_requests text requests queue up
            machine.generate(_Draw([]), fresh=3)
        before = machine.emb.stats()
        prompt, spans = prompt_of(["img-a"])
        try:
            machine.core.preallocate("late", spans, LEASE_S, prompt)
        except EngineError as error:
            assert error.kind is ErrorKind.RESOURCE_EXHAUSTED and error.retry_after_s
        else:
            raise AssertionError("Preallocate reserved room behind a full waiting queue")
        assert machine.emb.stats() == before
        machine.step(1)  # admitted ones leave the queue: room again
        [allocation] = machine.core.preallocate("later", spans, LEASE_S, prompt)
        assert not allocation.ready
        machine.core.abort("later")
    finally:
        machine.teardown()

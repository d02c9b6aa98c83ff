"""The KV hand-off in the engine core: P holds a finished prefill's blocks, D reserves, is filled,
admits and decodes (no model, no torch). After every test, nothing is left reserved or held."""

from __future__ import annotations

import pytest
from core_support import FakeClock, RunnerDouble, make_core

from services.pd.engine import kv_handoff
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.kv_handoff import ReservationState, Role
from services.pd.engine.outputs import Finished, TokenDelta
from services.pd.engine.request import MultiModalSpan, Request, RequestStatus, SamplingParams

LEASE_S = 10.0
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 10 tokens: 3 blocks of 4


def request(request_id="r", prompt=PROMPT, max_tokens=4, hand_off=False, **sampling) -> Request:
    req = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling), eos_token_ids=(99,))
    req.hand_off_kv = hand_off
    return req


def core(role: Role, clock: FakeClock, **limits):
    return make_core(clock=clock, num_blocks=16, block_size=4, runner=RunnerDouble(), role=role, **limits)


def run(engine, max_steps=50) -> dict[str, list]:
    events: dict[str, list] = {}
    for _ in range(max_steps):
        for request_id, event in engine.step().events:
            events.setdefault(request_id, []).append(event)
        if not engine.has_work():
            break
    return events


def tokens(events) -> list[int]:
    return [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]


def assert_clean(engine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats.is_idle
    assert stats.num_kv_blocks_used == 0
    assert stats.num_kv_reservations == stats.num_kv_exports == 0


@pytest.fixture
def clock():
    return FakeClock(100.0)


@pytest.fixture
def prefill(clock):
    engine = core(Role.PREFILL, clock)
    yield engine
    assert_clean(engine)


@pytest.fixture
def decode(clock):
    engine = core(Role.DECODE, clock)
    yield engine
    assert_clean(engine)


def prefill_and_hold(prefill, request_id="r", first=42, prompt=PROMPT):
    prefill.runner.tokens[request_id] = first
    prefill.add_request(request(request_id, prompt, max_tokens=1, hand_off=True))
    events = run(prefill)[request_id]
    assert tokens(events) == [first]
    export = prefill.take_export(request_id)
    assert export is not None and export.first_token_id == first and export.num_tokens == len(prompt)
    return export


def hand_over(prefill, decode, request_id="r", first=42, prompt=PROMPT, max_tokens=4, **sampling):
    grant = decode.reserve_kv(request_id, prompt, [], LEASE_S)
    export = prefill_and_hold(prefill, request_id, first, prompt)
    targets = decode.kv_push_targets(request_id, grant.reservation_id, len(export.block_ids) - grant.num_cached_blocks)
    assert len(targets) == grant.num_blocks - grant.num_cached_blocks
    decode.fill_kv(request_id, grant.reservation_id, export.first_token_id)
    prefill.release_export(request_id)
    decode.add_handed_off(request(request_id, prompt, max_tokens=max_tokens, **sampling), grant.reservation_id)
    return grant


def test_prefill_holds_the_prompt_blocks_until_the_push_lands(prefill):
    export = prefill_and_hold(prefill)
    assert len(export.block_ids) == 3
    stats = prefill.stats()
    assert stats.num_kv_exports == 1 and stats.num_kv_blocks_used == 3 and stats.num_live_requests == 0
    prefill.check_integrity()
    prefill.release_export("r")
    prefill.release_export("r")  # idempotent


def test_decode_continues_from_the_handed_over_first_token(prefill, decode):
    decode.runner.tokens["r"] = 5
    hand_over(prefill, decode)
    events = run(decode)["r"]
    assert tokens(events) == [42, 5, 5, 5]
    assert isinstance(events[-1], Finished) and events[-1].status is RequestStatus.FINISHED_LENGTH
    # D computed the first token's K/V itself: its first step was one decode row at the prompt's end.


def test_handed_over_request_decodes_like_one_served_whole(clock, prefill, decode):
    both = core(Role.BOTH, clock)
    both.runner.tokens["r"] = 42
    both.add_request(request("r", max_tokens=4))
    first = [e for _, e in both.step().events]  # the prefill samples 42
    both.runner.tokens["r"] = 5
    whole = tokens(first + run(both)["r"])
    decode.runner.tokens["r"] = 5
    hand_over(prefill, decode)
    assert tokens(run(decode)["r"]) == whole
    assert_clean(both)


def test_a_first_token_that_stops_finishes_on_decode_at_once(prefill, decode):
    hand_over(prefill, decode, first=99)
    assert decode.stats().num_live_requests == 0
    events = run(decode)["r"]
    assert tokens(events) == [99]
    assert events[-1].status is RequestStatus.FINISHED_STOPPED


def test_pushed_kv_is_never_served_to_another_request(prefill, decode):
    """A caller holding the token can push any K/V into its reservation: no later request may reuse it."""
    hand_over(prefill, decode)
    run(decode)
    grant = decode.reserve_kv("again", PROMPT + [11, 12], [], LEASE_S)
    assert grant.num_cached_blocks == 0  # the pushed blocks are keyed for their own request alone
    assert decode.kv_push_targets("again", grant.reservation_id, grant.num_blocks)
    decode.abort("again")


def test_decode_skips_the_blocks_it_computed_itself(clock, prefill):
    both = core(Role.BOTH, clock)
    both.add_request(request("whole", max_tokens=1))
    run(both)  # prefilled here: blocks 0-1 are full and registered
    grant = both.reserve_kv("again", PROMPT + [11, 12], [], LEASE_S)
    assert grant.num_cached_blocks == 2  # never the last token's block
    assert both.kv_push_targets("again", grant.reservation_id, grant.num_blocks - 2)
    both.abort("again")
    assert_clean(both)


def twin(of: Request, salted: bool) -> Request:
    """A fresh request with ``of``'s prompt (and its private salt when ``salted``), no blocks."""
    copy = request("twin", of.prompt_token_ids)
    if salted:
        copy.private_kv_salt, copy.private_kv_from = of.private_kv_salt, of.private_kv_from
    return copy


def test_a_handed_off_request_alone_finds_its_pushed_blocks_again(clock):
    """Re-admitted after a preemption, the request itself claims its pushed blocks (and D's own cached
    ones before them); a request without its salt finds only D's own."""
    prefill = core(Role.PREFILL, clock)
    decode = core(Role.BOTH, clock)
    decode.add_request(request("own", PROMPT[:5], max_tokens=1))
    run(decode)  # D computed block 0 itself
    grant = hand_over(prefill, decode, prompt=PROMPT + [11, 12, 13], max_tokens=8)
    assert grant.num_cached_blocks == 1
    handed = decode.scheduler.get_request("r")
    assert handed.private_kv_from == 1 and len(handed.private_kv_salt) == 16
    assert decode.kv_cache.get_computed_blocks(twin(handed, salted=True)) == (handed.block_ids[:3], 12)
    assert decode.kv_cache.get_computed_blocks(twin(handed, salted=False)) == (handed.block_ids[:1], 4)
    decode.abort("r")
    assert_clean(prefill)
    assert_clean(decode)


def test_one_callers_reservations_hold_at_most_their_share_of_slots(clock):
    decode = core(Role.DECODE, clock, max_num_seqs=4)  # share 0.5: two reservations a caller
    for request_id in ("a1", "a2"):
        decode.reserve_kv(request_id, PROMPT, [], LEASE_S, "", "ipv4:10.0.0.1")
    with pytest.raises(EngineError) as refused:
        decode.reserve_kv("a3", PROMPT, [], LEASE_S, "", "ipv4:10.0.0.1")
    assert refused.value.kind is ErrorKind.RESOURCE_EXHAUSTED and refused.value.retry_after_s
    decode.reserve_kv("b1", PROMPT, [], LEASE_S, "", "ipv4:10.0.0.2")  # another caller is served
    decode.abort("a1")
    decode.reserve_kv("a3", PROMPT, [], LEASE_S, "", "ipv4:10.0.0.1")  # room again
    for request_id in ("a2", "a3", "b1"):
        decode.abort(request_id)
    assert decode._reservations.held_by("ipv4:10.0.0.1") == (0, 0)
    assert_clean(decode)


def test_one_callers_reservations_hold_at_most_their_share_of_blocks(clock):
    decode = core(Role.DECODE, clock, max_num_seqs=16)  # 16 blocks: 8 a caller
    decode.reserve_kv("a1", PROMPT, [], LEASE_S, "", "ipv4:10.0.0.1")  # 3 blocks
    decode.reserve_kv("a2", PROMPT[:8], [], LEASE_S, "", "ipv4:10.0.0.1")  # 2 more
    with pytest.raises(EngineError) as refused:
        decode.reserve_kv("a3", PROMPT + [11, 12, 13], [], LEASE_S, "", "ipv4:10.0.0.1")  # 4 more: 9 > 8
    assert refused.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    long_prompt = list(range(1, 41))  # 10 blocks, over the share: a caller's only reservation may
    decode.reserve_kv("b1", long_prompt, [], LEASE_S, "", "ipv4:10.0.0.2")
    for request_id in ("a1", "a2", "b1"):
        decode.abort(request_id)
    assert_clean(decode)


def test_expired_reservation_frees_its_blocks_and_refuses_late_pushes(clock, decode):
    grant = decode.reserve_kv("r", PROMPT, [], LEASE_S)
    assert decode.stats().num_kv_blocks_used == 3
    clock.now += LEASE_S + 1
    decode.sweep()
    stats = decode.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_expired_kv_reservations == 1
    with pytest.raises(EngineError) as late:
        decode.kv_push_targets("r", grant.reservation_id, 3)
    assert late.value.kind is ErrorKind.DEADLINE_EXCEEDED


def test_a_lease_past_its_deadline_refuses_before_the_sweep(clock, decode):
    grant = decode.reserve_kv("r", PROMPT, [], LEASE_S)
    clock.now += LEASE_S + 1
    with pytest.raises(EngineError) as late:
        decode.fill_kv("r", grant.reservation_id, 1)
    assert late.value.kind is ErrorKind.DEADLINE_EXCEEDED
    decode.sweep()


def test_a_lease_past_its_deadline_aborted_before_the_sweep_still_counts_as_expired(clock, decode):
    """The proxy's Abort after a refused late push can come before the sweep: the lease still ran out."""
    grant = decode.reserve_kv("r", PROMPT, [], LEASE_S)
    decode.reserve_kv("live", PROMPT + [11], [], LEASE_S * 10)
    clock.now += LEASE_S + 1
    with pytest.raises(EngineError) as late:
        decode.kv_push_targets("r", grant.reservation_id, 3)
    assert late.value.kind is ErrorKind.DEADLINE_EXCEEDED
    decode.abort("r")
    decode.abort("live")  # aborted within its lease: not expired
    stats = decode.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_expired_kv_reservations == 1
    decode.sweep()
    assert decode.stats().num_expired_kv_reservations == 1  # counted once


@pytest.mark.parametrize(
    ("request_id", "reservation", "num_blocks", "kind"),
    [
        ("r", "kvres-unknown", 3, ErrorKind.NOT_FOUND),
        ("other", None, 3, ErrorKind.FAILED_PRECONDITION),
        ("r", None, 2, ErrorKind.FAILED_PRECONDITION),
    ],
)
def test_push_refusals_change_nothing(decode, request_id, reservation, num_blocks, kind):
    grant = decode.reserve_kv("r", PROMPT, [], LEASE_S)
    with pytest.raises(EngineError) as refused:
        decode.kv_push_targets(request_id, reservation or grant.reservation_id, num_blocks)
    assert refused.value.kind is kind
    assert decode.kv_push_targets("r", grant.reservation_id, 3)  # still wanted
    decode.abort("r")


def test_a_second_fill_and_a_generate_before_the_fill_are_refused(decode):
    grant = decode.reserve_kv("r", PROMPT, [], LEASE_S)
    with pytest.raises(EngineError) as early:
        decode.add_handed_off(request("r"), grant.reservation_id)
    assert early.value.kind is ErrorKind.FAILED_PRECONDITION
    decode.fill_kv("r", grant.reservation_id, 42)
    for attempt in (
        lambda: decode.fill_kv("r", grant.reservation_id, 42),
        lambda: decode.kv_push_targets("r", grant.reservation_id, 3),
    ):
        with pytest.raises(EngineError) as again:
            attempt()
        assert again.value.kind is ErrorKind.FAILED_PRECONDITION
    decode.abort("r")


def test_a_generate_with_another_prompt_is_refused(decode):
    grant = decode.reserve_kv("r", PROMPT, [], LEASE_S)
    decode.fill_kv("r", grant.reservation_id, 42)
    with pytest.raises(EngineError) as refused:
        decode.add_handed_off(request("r", prompt=PROMPT[:-1] + [77]), grant.reservation_id)
    assert refused.value.kind is ErrorKind.FAILED_PRECONDITION
    assert decode.stats().num_kv_reservations == 1  # the right Generate may still come
    decode.abort("r")


def test_reserve_refusals(clock, prefill):
    with pytest.raises(EngineError) as no_role:
        prefill.reserve_kv("r", PROMPT, [], LEASE_S)
    assert no_role.value.kind is ErrorKind.FAILED_PRECONDITION
    small = core(Role.DECODE, clock, max_num_seqs=1)
    small.reserve_kv("a", PROMPT, [], LEASE_S)
    for request_id, prompt, kind in [
        ("a", PROMPT, ErrorKind.ALREADY_EXISTS),
        ("b", PROMPT, ErrorKind.RESOURCE_EXHAUSTED),  # no decode slot
        ("b", [], ErrorKind.INVALID_ARGUMENT),
    ]:
        with pytest.raises(EngineError) as refused:
            small.reserve_kv(request_id, prompt, [], LEASE_S)
        assert refused.value.kind is kind
    small.abort("a")
    assert_clean(small)
    tight = make_core(clock=clock, num_blocks=4, block_size=4, role=Role.DECODE, max_model_len=16)
    tight.reserve_kv("a", PROMPT, [], LEASE_S)
    with pytest.raises(EngineError) as full:
        tight.reserve_kv("b", PROMPT, [], LEASE_S, "", "another caller")  # no free block
    assert full.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    tight.abort("a")
    assert_clean(tight)


def test_an_export_whose_push_never_ends_is_let_go_at_its_lease(clock, prefill):
    prefill_and_hold(prefill)
    clock.now += prefill.export_lease_s + 1
    prefill.sweep()
    assert prefill.take_export("r") is None


def test_an_aborted_hand_off_request_holds_nothing(prefill):
    prefill.add_request(request("r", max_tokens=1, hand_off=True))
    prefill.abort("r")
    assert prefill.take_export("r") is None


def test_image_spans_must_match_the_reservation(decode):
    spans = [MultiModalSpan("img", 2, 4, (1, 2, 2))]
    grant = decode.reserve_kv("r", PROMPT, spans, LEASE_S)
    decode.fill_kv("r", grant.reservation_id, 42)
    with pytest.raises(EngineError):
        decode.add_handed_off(request("r"), grant.reservation_id)  # no spans: not the reserved prompt
    ok = request("r")
    ok.mm_spans = list(spans)
    decode.add_handed_off(ok, grant.reservation_id)
    assert ok.rope_plan is None or ok.rope_plan is not None  # the plan is derived from the same spans
    decode.abort("r")


def test_reservation_table_remembers_a_bounded_number_of_expired_ids(monkeypatch):
    monkeypatch.setattr(kv_handoff, "EXPIRED_MEMORY", 2)
    table = kv_handoff.KVReservations()
    ids = [table.add(request(f"r{i}"), 1.0, 0).reservation_id for i in range(3)]
    assert [r.state for r in table] == [ReservationState.RESERVED] * 3
    assert len(table.expire(2.0)) == 3 and len(table) == 0
    with pytest.raises(EngineError) as forgotten:
        table.lookup("r0", ids[0], 2.0)
    assert forgotten.value.kind is ErrorKind.NOT_FOUND
    with pytest.raises(EngineError) as remembered:
        table.lookup("r2", ids[2], 2.0)
    assert remembered.value.kind is ErrorKind.DEADLINE_EXCEEDED


def test_an_abort_after_the_prefill_finished_lets_its_held_blocks_go(prefill):
    prefill_and_hold(prefill)
    prefill.abort("r")  # the client went away before the push started
    assert prefill.take_export("r") is None


class GrammarDouble:
    """Accepts every token but ``refused``."""

    def __init__(self, refused: int) -> None:
        self.refused, self.accepted = refused, []

    @property
    def num_accepted_tokens(self) -> int:
        return len(self.accepted)

    def accept(self, token_id: int) -> bool:
        if token_id == self.refused:
            return False
        self.accepted.append(token_id)
        return True

    @property
    def is_terminated(self) -> bool:
        return False


def test_the_decode_side_grammar_accepts_the_first_token_before_it_samples(prefill, decode):
    grant = decode.reserve_kv("r", PROMPT, [], LEASE_S)
    decode.fill_kv("r", grant.reservation_id, 42)
    refusing = request("r")
    refusing.grammar = GrammarDouble(refused=42)
    with pytest.raises(EngineError) as refused:
        decode.add_handed_off(refusing, grant.reservation_id)
    assert refused.value.kind is ErrorKind.FAILED_PRECONDITION
    assert decode.stats().num_kv_reservations == 1  # still there for the right Generate
    accepting = request("r")
    accepting.grammar = grammar = GrammarDouble(refused=-1)
    decode.add_handed_off(accepting, grant.reservation_id)
    assert grammar.accepted == [42]
    run(decode)
    assert grammar.accepted[0] == 42 and len(grammar.accepted) == 4  # the first token, then three sampled here


@pytest.mark.parametrize("share", [0.0, -0.5, 1.01])
def test_impossible_reservation_shares_are_refused(share):
    with pytest.raises(ValueError):
        kv_handoff.ReservationLimits(share)

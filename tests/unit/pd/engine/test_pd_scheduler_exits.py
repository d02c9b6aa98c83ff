"""Scheduler limits and every way a request ends (refusals, aborts, failures, stops), through the real engine core."""

from __future__ import annotations

import dataclasses
import random

import pytest
from scheduler_harness import EOS, IMAGES, IMG, LEASE, TOKEN, Harness, refusal

from services.pd.engine.embedding_records import EntryState
from services.pd.engine.errors import ErrorKind
from services.pd.engine.outputs import ModelRunnerOutput, SampledToken
from services.pd.engine.request import MultiModalSpan, Request, RequestStatus, SamplingParams
from services.pd.engine.scheduler import QueueFull, SchedulerConfig


def test_queue_bounds_and_invalid_requests(make):
    h = make(max_waiting_requests=2, max_waiting_tokens=10, max_model_len=12, num_blocks=4)
    h.add("a", range(3))
    assert refusal(h, "a", range(3)).kind is ErrorKind.ALREADY_EXISTS  # duplicate id
    h.add("b", range(4))
    full = refusal(h, "c", range(1))
    assert full.kind is ErrorKind.RESOURCE_EXHAUSTED and full.retry_after_s == 1.0
    h.step()  # both admitted: waiting is empty
    h.add("d", range(7))
    assert refusal(h, "x", range(4)).kind is ErrorKind.RESOURCE_EXHAUSTED  # 7 + 4 waiting tokens > 10
    never = refusal(h, "y", range(11))  # could never wait here, even alone
    assert never.kind is ErrorKind.INVALID_ARGUMENT and "waiting-queue" in never.message
    assert refusal(h, "e", range(13)).kind is ErrorKind.INVALID_ARGUMENT  # longer than max_model_len
    assert refusal(h, "f", []).kind is ErrorKind.INVALID_ARGUMENT
    bad = Request("h", [1, 2, 3], SamplingParams(), mm_spans=[MultiModalSpan("x", 2, 2)])
    with pytest.raises(ValueError):
        h.sched.add_request(bad)  # span past the prompt
    with pytest.raises(QueueFull):
        h.sched.check_room(4)
    h.check()
    small = make(num_blocks=2, block_size=4)
    assert refusal(small, "g", range(10), max_tokens=2).kind is ErrorKind.INVALID_ARGUMENT  # 3 blocks of 2


def test_finish_is_idempotent_and_releases_everything(h):
    request = h.add("a", [1, 2] + [IMG] * 4 + [3], spans=[("cat", 2, 4)])
    h.step()  # prefills [1, 2], waits for cat
    assert request.block_ids and h.emb.ref_count("cat") == 1
    assert h.core.abort("a") is request
    assert h.core.abort("a") is None
    assert request.status is RequestStatus.FINISHED_ABORTED and not request.block_ids
    assert h.emb.state("cat") is None  # its unfilled reservation is gone too
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert h.sched.schedule().finished_request_ids == ["a"]
    with pytest.raises(ValueError):
        h.sched.finish_request("a", RequestStatus.RUNNING)


def test_abort_of_a_waiting_request(make):
    h = make(max_num_seqs=1)
    h.add("a", [1, 2, 3], max_tokens=5)
    b = h.add("b", [4, 5, 6])
    h.step()
    assert h.core.abort("b") is b
    assert h.sched.num_waiting == 0
    h.run()


def test_failing_requests_waiting_on_an_expired_image(h):
    a = h.add("a", [1] + [IMG] * 4 + [2], spans=[("cat", 1, 4)])
    b = h.add("b", [IMG] * 4 + [3], spans=[("cat", 0, 4)])
    c = h.add("c", [IMG] * 4 + [3], spans=[("dog", 0, 4)])
    h.step()
    assert h.sched.requests_waiting_on("cat") == [a, b] and h.sched.requests_waiting_on("dog") == [c]
    h.clock.now = LEASE + 1
    h.core.sweep()  # both pushes are lost: their entries go
    assert h.emb.state("cat") is None and h.emb.state("dog") is None
    _, failed = h.step()
    assert failed == [a, b, c]
    assert all(r.status is RequestStatus.FINISHED_ERROR for r in failed)
    assert not h.sched.has_unfinished_requests()


def test_missing_embedding_detected_without_engine_help(h):
    request = h.add("a", [1] + [IMG] * 4 + [2], spans=[("cat", 1, 4)])
    h.step()
    h.emb.expire(now=LEASE + 1)  # dropped; nobody told the scheduler
    out, finished = h.step()
    assert finished == [request] and request.status is RequestStatus.FINISHED_ERROR


def test_update_ignores_chunks_of_requests_finished_meanwhile(h):
    request = h.add("a", [1, 2, 3])
    out = h.sched.schedule()
    h.core.abort("a")  # between the schedule and the update
    sampled = {"a": SampledToken(TOKEN)}
    assert h.sched.update_from_output(out, ModelRunnerOutput(sampled)) == []
    assert request.output_token_ids == []


def test_missing_sampled_token_fails_the_request(h):
    request = h.add("a", [1, 2, 3])
    h.runner.omit.add("a")
    _, finished = h.step()
    assert finished == [request]
    assert request.status is RequestStatus.FINISHED_ERROR and request.error == "the model step sampled no token"


def test_config_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(max_model_len=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SchedulerConfig(max_model_len=8).max_num_seqs = 2  # type: ignore[misc]


@pytest.mark.parametrize("ordered", [False, True], ids=["fcfs", "keyed"])
@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_invariants(seed, ordered, make):
    """Random arrivals, images, pushes, lost pushes, aborts, tight KV and prefill budgets, and
    (keyed) prefill served in a random order that changes every step: every step keeps the budgets
    and all invariants, and every request ends with nothing leaked."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    h = make(
        num_blocks=rng.randint(40, 56) // block_size,
        block_size=block_size,
        budget=rng.choice([3, 8, 32]),
        max_num_seqs=rng.randint(1, 6),
        embedding_tokens=64,
        prefix_caching=rng.random() < 0.8,
    )
    pending: list[tuple[str, str]] = []
    num_added, ended = 0, []
    for _ in range(300):
        if num_added < 25 and rng.random() < 0.4:
            _add_random(h, rng, f"r{num_added}", pending)
            num_added += 1
        if pending and rng.random() < 0.4:
            item = pending.pop(rng.randrange(len(pending)))
            if rng.random() < 0.9:
                h.push(*item)  # else lost: the encoder failed
        if h.sched.num_running and rng.random() < 0.03:
            victim = rng.choice(h.sched.running)
            h.core.abort(victim.request_id)  # its end arrives with the next step's events
        tokens = {r.request_id: rng.choice([TOKEN, TOKEN, TOKEN, EOS]) for r in h.sched.running}
        priority = {r.request_id: rng.random() for r in h.requests.values()}
        key = (lambda r, p=priority: p[r.request_id]) if ordered else None
        ended += h.step(tokens, prefill_budget=rng.choice([None, None, 1, 2, 5]), prefill_key=key)[1]
    for item in pending:
        h.push(*item)
    # Lost pushes: the lease sweep drops their entries and fails whoever waits on them.
    h.clock.now += LEASE + 1
    h.core.sweep()
    ended += h.run(max_steps=2000)
    assert len(ended) == num_added
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert all(h.emb.ref_count(x) == 0 for x in IMAGES)
    assert h.emb.stats().num_reservations == 0


def _add_random(h: Harness, rng: random.Random, request_id: str, pending: list) -> None:
    prompt, spans = [], []
    for _ in range(rng.randint(0, 2)):
        prompt += [rng.randint(3, 6) for _ in range(rng.randint(0, 5))]
        mm_hash = rng.choice(IMAGES)
        if mm_hash in {s[0] for s in spans}:
            continue
        spans.append((mm_hash, len(prompt), 6))  # every image of a hash has 6 rows
        prompt += [IMG] * 6
    prompt += [rng.randint(3, 6) for _ in range(rng.randint(1, 6))]
    h.add(request_id, prompt, spans=spans, max_tokens=rng.randint(1, 12))
    pending += [(request_id, s[0]) for s in spans if h.emb.state(s[0]) is EntryState.RESERVED]

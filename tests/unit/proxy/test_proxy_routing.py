"""Routing policies, circuit breaker, placeholder expansion (pure Python, no servers)."""

from __future__ import annotations

import pytest

from services.common.pb import epd_pb2
from services.proxy.backends.instances import (
    BreakerState,
    CircuitBreaker,
    EncoderClient,
    Outcome,
    PdClient,
    Readiness,
    outcome_of,
)
from services.proxy.backends.pools import Backends
from services.proxy.backends.routing import (
    LeastLoadedEncoderPolicy,
    LeastLoadedPdPolicy,
    RendezvousPolicy,
    RoundRobinEncoderPolicy,
    RoundRobinPdPolicy,
    make_encoder_policy,
    make_pd_policy,
)
from services.proxy.dispatch.jobs import Job
from services.proxy.dispatch.pipeline import Pipeline
from services.proxy.errors import ApiError, PlaceholderMismatchError
from services.proxy.prompt.placeholders import expand_placeholders
from services.proxy.prompt.preprocess import Prompt
from services.proxy.trace import new_request_id


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeChannel:
    """Stands in for a gRPC channel: the stubs only need ``unary_unary`` etc. to exist."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    async def close(self) -> None:
        pass


def pds(n: int, clock=None) -> list[PdClient]:
    clock = clock or FakeClock()
    return [PdClient(f"pd{i}:1", FakeChannel(), breaker=CircuitBreaker(clock=clock), clock=clock) for i in range(n)]


def encoders(n: int, clock=None) -> list[EncoderClient]:
    clock = clock or FakeClock()
    return [
        EncoderClient(f"enc{i}:1", FakeChannel(), breaker=CircuitBreaker(clock=clock), clock=clock) for i in range(n)
    ]


class FakePool:
    """A fixed list of instances in place of a DNS-following ``Pool``."""

    has_dns_targets = False

    def __init__(self, instances) -> None:
        self.instances = list(instances)
        self.targets = [i.address for i in instances]

    async def refresh(self) -> None:
        pass

    def all_instances(self):
        return self.instances


async def static_backends(pd_list, encoder_list, pd_policy="least-loaded", encoder_policy="rendezvous") -> Backends:
    backends = Backends(
        FakePool(pd_list),
        FakePool(encoder_list),
        pd_policy=make_pd_policy(pd_policy),
        encoder_policy=make_encoder_policy(encoder_policy, saturation=4),
    )
    await backends.start()
    return backends


def addresses(instances) -> list[str]:
    return [i.address for i in instances]


# --------------------------------------------------------------------------- PD policies


def test_least_loaded_prefers_idle_and_rotates_ties():
    instances = pds(3)
    policy = LeastLoadedPdPolicy()
    instances[0].num_outstanding = 5
    firsts = [policy.rank(instances)[0].address for _ in range(4)]
    assert "pd0:1" not in firsts
    assert set(firsts) == {"pd1:1", "pd2:1"}  # ties rotate
    instances[1].num_outstanding = 1
    assert addresses(policy.rank(instances)) == ["pd2:1", "pd1:1", "pd0:1"]


def test_least_loaded_counts_other_proxies_work_from_get_load():
    instances = pds(2)
    policy = LeastLoadedPdPolicy()
    instances[0].num_outstanding = 2
    instances[0].set_load(epd_pb2.PdLoad(num_running=2, num_waiting=0))  # all of it ours
    instances[1].set_load(epd_pb2.PdLoad(num_running=4, num_waiting=3))  # another proxy's
    assert instances[0].estimated_load() == 2 and instances[1].estimated_load() == 7
    assert addresses(policy.rank(instances)) == ["pd0:1", "pd1:1"]
    # Our own calls since the poll add up on top of the others' share.
    instances[1].num_outstanding = 1
    assert instances[1].estimated_load() == 8


def test_least_loaded_puts_busy_last_and_breaks_ties_by_kv_usage():
    clock = FakeClock()
    instances = pds(3, clock)
    policy = LeastLoadedPdPolicy()
    instances[0].set_load(epd_pb2.PdLoad(num_kv_blocks_used=90, num_kv_blocks_total=100))
    instances[1].set_load(epd_pb2.PdLoad(num_kv_blocks_used=10, num_kv_blocks_total=100))
    instances[2].mark_busy(1.0)
    assert addresses(policy.rank(instances)) == ["pd1:1", "pd0:1", "pd2:1"]
    clock.now += 1.5
    assert addresses(policy.rank(instances))[0] == "pd2:1"  # no KV data: 0% used


def test_round_robin_pd_ignores_load():
    instances = pds(3)
    instances[0].num_outstanding = 10
    policy = RoundRobinPdPolicy()
    assert [policy.rank(instances)[0].address for _ in range(3)] == ["pd0:1", "pd1:1", "pd2:1"]


# --------------------------------------------------------------------------- encoder policies


def test_rendezvous_is_stable_and_spreads():
    policy, instances = RendezvousPolicy(), encoders(4)
    hashes = [f"{i:064x}" for i in range(200)]
    first = {h: policy.rank(instances, h)[0].address for h in hashes}
    assert first == {h: policy.rank(instances, h)[0].address for h in hashes}  # deterministic
    counts = {a: list(first.values()).count(a) for a in set(first.values())}
    assert len(counts) == 4 and min(counts.values()) > 20


def test_rendezvous_moves_only_the_removed_encoders_images():
    policy, full = RendezvousPolicy(), encoders(4)
    for h in (f"{i:064x}" for i in range(100)):
        owner = policy.rank(full, h)[0].address
        if owner != "enc3:1":
            assert policy.rank(full[:3], h)[0].address == owner


def test_rendezvous_falls_back_to_least_loaded_when_the_preferred_is_saturated():
    policy, instances = RendezvousPolicy(saturation=4), encoders(3)
    h = "ab" * 32
    preferred, second, third = policy.rank(instances, h)
    preferred.num_outstanding = 3
    assert policy.rank(instances, h)[0] is preferred  # below the threshold: affinity wins
    preferred.num_outstanding = 4
    second.num_outstanding = 2
    assert policy.rank(instances, h) == [third, second, preferred]  # least loaded unsaturated first
    preferred.num_outstanding = 0
    preferred.set_load(epd_pb2.EncoderLoad(num_pending=9))  # another proxy filled it
    assert policy.rank(instances, h)[0] is third
    preferred.set_load(epd_pb2.EncoderLoad(num_pending=0))
    preferred.mark_busy(1.0)  # it just said RESOURCE_EXHAUSTED
    assert policy.rank(instances, h)[-1] is preferred


def test_least_loaded_and_round_robin_encoders():
    instances = encoders(3)
    instances[0].num_outstanding = 3
    instances[1].num_outstanding = 1
    assert LeastLoadedEncoderPolicy().rank(instances, "x")[0].address == "enc2:1"
    policy = RoundRobinEncoderPolicy()
    assert [policy.rank(instances, "x")[0].address for _ in range(3)] == ["enc0:1", "enc1:1", "enc2:1"]


# --------------------------------------------------------------------------- breaker and routability


def test_breaker_opens_after_consecutive_failures_then_probes_once():
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=2, open_s=1.0, max_open_s=3.0, clock=clock)
    breaker.on_end(Outcome.FAILURE)
    breaker.on_end(Outcome.SUCCESS)  # a success resets the count
    breaker.on_end(Outcome.FAILURE)
    assert breaker.allows()
    breaker.on_end(Outcome.FAILURE)
    assert breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now += 1.0
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_start()  # the probe
    assert not breaker.allows()  # one at a time
    breaker.on_end(Outcome.FAILURE)  # failed probe: open for twice as long
    clock.now += 1.5
    assert breaker.state is BreakerState.OPEN
    clock.now += 0.6
    breaker.on_start()
    breaker.on_end(Outcome.NEUTRAL)  # a neutral probe only frees the slot
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_start()
    breaker.on_end(Outcome.SUCCESS)
    assert breaker.state is BreakerState.CLOSED


def test_breaker_backoff_is_capped():
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=1, open_s=1.0, max_open_s=3.0, clock=clock)
    breaker.on_end(Outcome.FAILURE)
    for _ in range(5):
        clock.now += 3.0
        assert breaker.state is BreakerState.HALF_OPEN
        breaker.on_start()
        breaker.on_end(Outcome.FAILURE)


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        ("OK", Outcome.SUCCESS),
        ("UNAVAILABLE", Outcome.FAILURE),
        ("INTERNAL", Outcome.FAILURE),
        ("DEADLINE_EXCEEDED", Outcome.NEUTRAL),
        ("RESOURCE_EXHAUSTED", Outcome.NEUTRAL),
        ("INVALID_ARGUMENT", Outcome.NEUTRAL),
        ("CANCELLED", Outcome.NEUTRAL),
    ],
)
def test_outcome_of_status(code, outcome):
    import grpc

    assert outcome_of(getattr(grpc.StatusCode, code)) is outcome


async def test_only_routable_instances_are_offered():
    pd_list, encoder_list = pds(3), encoders(2)
    backends = await static_backends(pd_list, encoder_list)
    pd_list[0].set_readiness(Readiness.NOT_READY)
    for _ in range(3):
        pd_list[1].begin()
        pd_list[1].end(Outcome.FAILURE)  # breaker opens
    assert addresses(backends.pd_candidates()) == ["pd2:1"]
    assert backends.pd_candidates(exclude={"pd2:1"}) == []
    pd_list[0].set_readiness(Readiness.READY)  # recovered
    assert sorted(addresses(backends.pd_candidates())) == ["pd0:1", "pd2:1"]
    encoder_list[1].retired = True
    assert addresses(backends.encoder_candidates("x")) == ["enc0:1"]
    report = backends.health_report()
    assert report["pd"] == {"pd0:1": True, "pd1:1": False, "pd2:1": False}  # pd2 never reported: unknown


async def test_lease_is_capped_by_the_deadline_and_a_spent_deadline_is_504():
    clock = FakeClock()
    backends = await static_backends(pds(1, clock), encoders(1, clock))
    job = Job(new_request_id(), Prompt([1, 2]), epd_pb2.SamplingParams(), deadline=clock.now + 3.0)
    assert Pipeline(backends, lease_ms=0, clock=clock).calls.lease_ms(job) == 3000  # none set: the deadline (defect 12)
    assert Pipeline(backends, lease_ms=1000, clock=clock).calls.lease_ms(job) == 1000
    assert Pipeline(backends, lease_ms=9000, clock=clock).calls.lease_ms(job) == 3000
    clock.now += 3.5
    with pytest.raises(ApiError) as caught:
        Pipeline(backends, lease_ms=9000, clock=clock).calls.remaining(job)
    assert caught.value.status_code == 504


def test_request_ids_are_fresh():
    ids = {new_request_id("chatcmpl") for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("chatcmpl-") and len(i) == 41 for i in ids)
    job = Job(ids.pop(), Prompt([1]), epd_pb2.SamplingParams(), deadline=0.0)
    assert job.attempt_id(0) == job.request_id and job.attempt_id(2) == job.request_id + "-r2"


# --------------------------------------------------------------------------- placeholder expansion

IMG = 99


def test_expand_placeholders_offsets():
    ids, offsets = expand_placeholders([1, IMG, 2, 3, IMG, 4], IMG, [3, 2])
    assert ids == [1, IMG, IMG, IMG, 2, 3, IMG, IMG, 4]
    assert offsets == [1, 6]


def test_expand_adjacent_and_edge_placeholders():
    ids, offsets = expand_placeholders([IMG, IMG], IMG, [2, 1])
    assert ids == [IMG] * 3 and offsets == [0, 2]


def test_expand_without_images_is_identity():
    assert expand_placeholders([1, 2], IMG, []) == ([1, 2], [])


@pytest.mark.parametrize(("ids", "counts"), [([1, IMG, IMG], [4]), ([1, 2], [4]), ([IMG], [])])
def test_placeholder_count_must_match_images(ids, counts):
    with pytest.raises(PlaceholderMismatchError):
        expand_placeholders(ids, IMG, counts)


async def test_a_colocated_pd_encodes_only_its_own_images():
    """Addresses listed as PD and encoder are colocated PDs (``epd pd --encoder local``)."""
    pd_list = pds(2)
    colocated = [
        EncoderClient(p.address, FakeChannel(), breaker=CircuitBreaker(clock=FakeClock()), clock=FakeClock())
        for p in pd_list
    ]
    remote = encoders(1)
    backends = await static_backends(pd_list, colocated + remote)
    for mm_hash in ("a", "b", "c", "d"):
        assert addresses(backends.encoder_candidates(mm_hash, pd_address="pd1:1")) == ["pd1:1", "enc0:1"]
        assert addresses(backends.encoder_candidates(mm_hash, pd_address="pd0:1")) == ["pd0:1", "enc0:1"]
    # Without a target PD only real encoders are offered.
    assert addresses(backends.encoder_candidates("a")) == ["enc0:1"]

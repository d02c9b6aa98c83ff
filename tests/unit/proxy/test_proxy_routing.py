"""Routing policies and placeholder expansion (pure Python, no servers)."""

from __future__ import annotations

import pytest

from services.common.pb import epd_pb2
from services.proxy.backends import (
    Backends,
    EncoderClient,
    LeastOutstandingRouter,
    PdClient,
    RendezvousRouter,
    RoundRobinRouter,
)
from services.proxy.errors import ApiError, PlaceholderMismatchError
from services.proxy.pipeline import Job, Pipeline, new_request_id
from services.proxy.preprocess import Prompt, expand_placeholders


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeChannel:
    """Stands in for a gRPC channel: the stubs only need ``unary_unary`` etc. to exist."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def pds(n: int, clock=None) -> list[PdClient]:
    return [PdClient(f"pd{i}:1", FakeChannel(), clock or FakeClock()) for i in range(n)]


def encoders(n: int, clock=None) -> list[EncoderClient]:
    return [EncoderClient(f"enc{i}:1", FakeChannel(), clock or FakeClock()) for i in range(n)]


def test_least_outstanding_prefers_idle_and_rotates_ties():
    instances = pds(3)
    router = LeastOutstandingRouter(instances)
    instances[0].num_outstanding = 5
    firsts = [router.candidates()[0].address for _ in range(4)]
    assert "pd0:1" not in firsts
    assert set(firsts) == {"pd1:1", "pd2:1"}  # ties rotate
    instances[1].num_outstanding = 1
    assert [p.address for p in router.candidates()] == ["pd2:1", "pd1:1", "pd0:1"]


def test_instance_in_cooldown_goes_last_then_recovers():
    clock = FakeClock()
    instances = pds(2, clock)
    router = LeastOutstandingRouter(instances)
    instances[1].num_outstanding = 3
    instances[0].mark_down(2.0)
    assert router.candidates()[0].address == "pd1:1"
    clock.now += 2.5
    assert router.candidates()[0].address == "pd0:1"


def test_rendezvous_is_stable_and_spreads():
    router = RendezvousRouter(encoders(4))
    hashes = [f"{i:064x}" for i in range(200)]
    first = {h: router.rank(h)[0].address for h in hashes}
    assert first == {h: router.rank(h)[0].address for h in hashes}  # deterministic
    counts = {a: list(first.values()).count(a) for a in set(first.values())}
    assert len(counts) == 4 and min(counts.values()) > 20


def test_rendezvous_moves_only_the_removed_encoders_images():
    full = encoders(4)
    before = RendezvousRouter(full)
    after = RendezvousRouter(full[:3])
    for h in (f"{i:064x}" for i in range(100)):
        owner = before.rank(h)[0].address
        if owner != "enc3:1":
            assert after.rank(h)[0].address == owner


def test_rendezvous_failover_order_skips_down_encoder():
    instances = encoders(3)
    router = RendezvousRouter(instances)
    ranked = router.rank("ab" * 32)
    ranked[0].mark_down(5.0)
    assert router.rank("ab" * 32) == ranked[1:] + ranked[:1]


def test_round_robin_rotates():
    router = RoundRobinRouter(encoders(3))
    assert [router.rank("x")[0].address for _ in range(3)] == ["enc0:1", "enc1:1", "enc2:1"]


def test_lease_is_capped_by_the_deadline_and_a_spent_deadline_is_504():
    clock = FakeClock()
    backends = Backends(pds(1, clock), encoders(1, clock))
    job = Job(new_request_id(), Prompt([1, 2]), epd_pb2.SamplingParams(), deadline=clock.now + 3.0)
    assert Pipeline(backends, lease_ms=0, clock=clock).lease_ms(job) == 0           # PD default
    assert Pipeline(backends, lease_ms=1000, clock=clock).lease_ms(job) == 1000
    assert Pipeline(backends, lease_ms=9000, clock=clock).lease_ms(job) == 3000
    clock.now += 3.5
    with pytest.raises(ApiError) as caught:
        Pipeline(backends, lease_ms=9000, clock=clock).remaining(job)
    assert caught.value.status_code == 504


def test_request_ids_are_fresh():
    ids = {new_request_id("chatcmpl") for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("chatcmpl-") and len(i) == 41 for i in ids)


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

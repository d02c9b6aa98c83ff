"""The per-client limiter's policy, on a fake clock (services/proxy/web/fairness.py)."""

from __future__ import annotations

import pytest

from services.proxy.errors import ApiError
from services.proxy.web.fairness import (
    ClientLimiter,
    FairnessLimits,
    address_identity,
    key_identity,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limiter(max_requests: int = 0, tokens_per_minute: int = 0):
    clock, refusals = FakeClock(), []
    limiter = ClientLimiter(FairnessLimits(max_requests, tokens_per_minute), clock=clock, on_refusal=refusals.append)
    return limiter, clock, refusals


def _refused(limiter: ClientLimiter, client: str, **work: int) -> ApiError:
    with pytest.raises(ApiError) as caught:
        limiter.admit(client, **work)
    error = caught.value
    assert error.status_code == 429 and error.error_type == "rate_limit_error" and error.code == "too_many_requests"
    return error


def test_off_by_default_admits_everything_and_counts_nothing():
    limiter, _, refusals = _limiter()
    admissions = [limiter.admit("a", num_choices=8, prompt_tokens=4000, max_tokens=16384) for _ in range(100)]
    assert limiter.num_in_flight == {} and refusals == []
    for admission in admissions:
        admission.release()
    limiter.check_idle()


def test_requests_in_flight_count_choices_per_client_and_release_is_idempotent():
    limiter, _, refusals = _limiter(max_requests=3)
    first = limiter.admit("a", num_choices=2, prompt_tokens=1, max_tokens=1)
    error = _refused(limiter, "a", num_choices=2, prompt_tokens=1, max_tokens=1)
    assert error.retry_after_s == 1 and refusals == ["requests"]
    other = limiter.admit("b", num_choices=3, prompt_tokens=1, max_tokens=1)  # its own count
    one_more = limiter.admit("a", num_choices=1, prompt_tokens=1, max_tokens=1)
    assert limiter.num_in_flight == {"a": 3, "b": 3}
    first.release()
    first.release()  # a second release changes nothing
    assert limiter.num_in_flight == {"a": 1, "b": 3}
    for admission in (other, one_more):
        admission.release()
    limiter.check_idle()


def test_the_token_bucket_refuses_with_its_refill_time_then_admits_after_refill():
    limiter, clock, refusals = _limiter(tokens_per_minute=600)  # 10 tokens per second
    limiter.admit("a", num_choices=2, prompt_tokens=100, max_tokens=200).release()  # 500 charged, none used...
    # ...so all 400 completion tokens came back: 500 - 100 = 500 left after the prompt's 100.
    assert limiter._buckets["a"].tokens == pytest.approx(500)
    held = limiter.admit("a", num_choices=1, prompt_tokens=100, max_tokens=300)  # 400 charged: 100 left
    error = _refused(limiter, "a", num_choices=1, prompt_tokens=50, max_tokens=100)  # 150 > 100
    assert error.retry_after_s == 5 and refusals == ["tokens"]  # 50 missing at 10 per second
    clock.now += 4.9
    _refused(limiter, "a", num_choices=1, prompt_tokens=50, max_tokens=100)
    clock.now += 0.2
    limiter.admit("a", num_choices=1, prompt_tokens=50, max_tokens=100).release()
    limiter.admit("b", num_choices=1, prompt_tokens=100, max_tokens=400).release()  # another client's bucket
    held.add_used(300)  # every token used: nothing refunded
    held.release()
    clock.now += 60
    limiter.admit("a", num_choices=1, prompt_tokens=100, max_tokens=500).release()  # full again, never above 600
    assert limiter._buckets["a"].tokens <= 600
    limiter.check_idle()


def test_a_request_larger_than_the_whole_bucket_is_refused_for_good():
    limiter, _, refusals = _limiter(tokens_per_minute=1000)
    error = _refused(limiter, "a", num_choices=8, prompt_tokens=10, max_tokens=200)
    assert error.retry_after_s == 60 and "1000 per minute" in error.message and refusals == ["tokens"]
    assert limiter._buckets["a"].tokens == 1000  # nothing charged


def test_a_refused_request_holds_no_slot_and_no_tokens():
    limiter, _, _ = _limiter(max_requests=1, tokens_per_minute=100)
    held = limiter.admit("a", num_choices=1, prompt_tokens=10, max_tokens=10)
    _refused(limiter, "a", num_choices=1, prompt_tokens=10, max_tokens=10)
    assert limiter.num_in_flight == {"a": 1} and limiter._buckets["a"].tokens == pytest.approx(80)
    held.release()
    limiter.check_idle()


def test_idle_full_buckets_are_swept_once_the_table_is_large():
    limiter, clock, _ = _limiter(tokens_per_minute=60)
    for index in range(1023):
        limiter.admit(f"c{index}", num_choices=1, prompt_tokens=1, max_tokens=1).release()
    clock.now += 61  # every bucket so far is full again
    limiter.admit("late", num_choices=1, prompt_tokens=1, max_tokens=1).release()  # the 1024th bucket
    limiter.admit("later", num_choices=1, prompt_tokens=1, max_tokens=1).release()  # sweeps before adding
    assert set(limiter._buckets) == {"late", "later"}  # "late" still owes its prompt token


def test_identities_hide_the_key_and_name_the_address():
    key = "sk-very-secret-key"
    assert key_identity(key) == key_identity(key) != key_identity(key + "x")
    assert key not in key_identity(key) and len(key_identity(key)) == len("key:") + 12
    assert address_identity("10.0.0.2") == "addr:10.0.0.2" and address_identity(None) == "addr:unknown"

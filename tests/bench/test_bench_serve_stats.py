"""``epd bench serve`` statistics: percentiles, per-request latencies, run summaries, goodput."""

from __future__ import annotations

import math

import pytest

from services.bench.serve.stats import (
    RequestRecord,
    Slo,
    goodput,
    meets_slo,
    nearest_rate,
    percentile,
    ratio,
    saturation_rate,
    stat,
    summarize,
    summarize_run,
)


def record(index=0, kind="text", times=(0.1, 0.2, 0.3), end=0.35, start=0.0, image_class=None, error=None, prompt=10):
    return RequestRecord(
        index=index,
        kind=kind,
        num_images=0 if kind == "text" else 1,
        image_class=image_class,
        scheduled_s=start,
        start_s=start,
        token_times_s=list(times),
        end_s=end,
        prompt_tokens=prompt,
        error=error,
    )


def test_percentile_interpolates_like_numpy_linear():
    values = [4.0, 1.0, 3.0, 2.0]  # order must not matter
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_empty_input_and_bad_q():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_reports_milliseconds_and_none_when_empty():
    summary = summarize([0.001, 0.002, 0.003])
    assert summary == {"n": 3, "mean": 2.0, "median": 2.0, "p90": 2.8, "p99": 2.98}
    assert summarize([]) == {"n": 0, "mean": None, "median": None, "p90": None, "p99": None}


def test_request_latencies_follow_the_vllm_definitions():
    r = record(times=(0.1, 0.1, 0.25, 0.4), end=0.5)
    assert r.ok and r.num_tokens == 4
    assert r.ttft == 0.1
    assert r.e2e == 0.5
    assert r.tpot == pytest.approx((0.5 - 0.1) / 3)
    # Two tokens in one chunk: one real gap and a zero, never spread out.
    assert r.itls == pytest.approx([0.0, 0.15, 0.15])


def test_single_token_requests_have_no_tpot_and_failed_ones_are_not_ok():
    assert record(times=(0.1,), end=0.1).tpot is None
    assert not record(error="HTTP 503").ok
    assert not record(times=(), end=0.2).ok
    assert not record(end=None).ok


def test_summarize_run_counts_throughput_failures_and_groups():
    records = [
        record(0, "text", (0.1, 0.2), 0.2, start=0.0),
        record(1, "image", (0.5, 0.6), 0.7, start=0.3, image_class="first_seen"),
        record(2, "image", (0.2, 0.3), 0.3, start=0.5, image_class="repeated"),
        record(3, "text", (), None, start=0.9, error="HTTP 503"),
    ]
    summary = summarize_run(records)
    assert summary["num_requests"] == 4 and summary["num_ok"] == 3 and summary["num_failed"] == 1
    assert summary["errors"] == {"HTTP 503": 1}
    assert summary["duration_s"] == 1.0  # first send 0.0 -> last end 0.3 + 0.7
    assert summary["request_throughput"] == 3.0
    assert summary["output_token_throughput"] == 6.0
    assert summary["total_token_throughput"] == 36.0
    assert set(summary["groups"]) == {"all", "text", "image", "first_seen", "repeated"}
    assert summary["groups"]["text"]["num_requests"] == 2
    assert stat(summary, "text", "ttft", "mean") == 100.0  # the failed text request has no TTFT
    assert stat(summary, "image", "ttft", "mean") == 350.0
    assert stat(summary, "repeated", "ttft", "p99") == 200.0
    assert stat(summary, "missing", "ttft", "p99") is None


def test_first_seen_and_repeated_groups_only_when_something_repeats():
    summary = summarize_run([record(0, "image", image_class="first_seen"), record(1)])
    assert set(summary["groups"]) == {"all", "text", "image"}


def test_long_prompt_requests_are_a_group_of_their_own_beside_short_text():
    summary = summarize_run([record(0, "text", (0.1, 0.2)), record(1, "long", (2.0, 2.5), 2.5), record(2)])
    assert set(summary["groups"]) == {"all", "text", "long"}
    assert summary["groups"]["text"]["num_requests"] == 2 and summary["groups"]["long"]["num_requests"] == 1
    assert stat(summary, "text", "itl", "p99") == 100.0  # the long prompt's 500 ms gap is not a short stream's
    assert stat(summary, "long", "ttft", "mean") == 2000.0


def summary_with(p99_ttft_ms, p99_tpot_ms, failed=0, throughput=1.0):
    return {
        "num_failed": failed,
        "request_throughput": throughput,
        "groups": {"all": {"ttft": {"p99": p99_ttft_ms}, "tpot": {"p99": p99_tpot_ms}}},
    }


def test_meets_slo_needs_both_percentiles_and_no_failure():
    slo = Slo(ttft_ms=100, tpot_ms=10)
    assert meets_slo(summary_with(100, 10), slo)
    assert not meets_slo(summary_with(101, 10), slo)
    assert not meets_slo(summary_with(100, 10.5), slo)
    assert not meets_slo(summary_with(50, 5, failed=1), slo)
    assert not meets_slo(summary_with(None, 5), slo)


def test_goodput_is_the_highest_rate_below_which_every_rate_meets_the_slo():
    slo = Slo(ttft_ms=100, tpot_ms=10)
    runs = {
        1.0: summary_with(50, 5),
        2.0: summary_with(80, 8),
        4.0: summary_with(300, 9),
        8.0: summary_with(90, 9),
    }  # a noisy pass above a failure does not count
    result = goodput(runs, slo)
    assert result["rate"] == 2.0
    assert result["lower_bound"] is False
    assert result["passed"] == {"1": True, "2": True, "4": False, "8": True}


def test_goodput_edges_none_passing_and_all_passing():
    slo = Slo(ttft_ms=100, tpot_ms=10)
    assert goodput({1.0: summary_with(500, 5)}, slo)["rate"] == 0.0
    everything = goodput({1.0: summary_with(5, 5), 3.0: summary_with(5, 5)}, slo)
    assert everything["rate"] == 3.0 and everything["lower_bound"] is True


def test_ratio_nearest_rate_and_saturation():
    assert ratio(1.0, 4.0) == 0.25
    assert ratio(None, 4.0) is None and ratio(1.0, 0.0) is None
    assert nearest_rate([0.5, 1.0, 2.0, 4.0], 2.7) == 2.0  # log scale: 2.7 is nearer 2 than 4
    assert nearest_rate([0.5, 1.0, 2.0, 4.0], 3.0) == 4.0
    with pytest.raises(ValueError):
        nearest_rate([], 1.0)
    runs = {
        1.0: summary_with(1, 1, throughput=0.9),
        2.0: summary_with(1, 1, throughput=1.6),
        4.0: summary_with(1, 1, throughput=1.5),
    }
    assert saturation_rate(runs) == 1.6
    assert saturation_rate({}) is None
    assert math.isclose(saturation_rate({1.0: summary_with(1, 1, throughput=2.0)}), 2.0)

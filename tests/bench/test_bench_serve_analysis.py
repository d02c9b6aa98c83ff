"""``epd bench serve`` analysis and report: ratios to (c), the issue's targets, the markdown tables."""

from __future__ import annotations

from services.bench.serve.analysis import (
    analyze,
    evaluate_targets,
    ratios_to_disagg,
    target_rate,
)
from services.bench.serve.stats import Slo


def summary(throughput, text_itl_p99, text_ttft_mean, p99_ttft=100.0, p99_tpot=10.0, repeated=None, first=None):
    groups = {
        "all": {
            "num_requests": 10,
            "ttft": {"mean": text_ttft_mean, "p99": p99_ttft},
            "tpot": {"p99": p99_tpot},
            "itl": {"p99": text_itl_p99},
            "e2e": {"mean": 1.0},
        },
        "text": {"num_requests": 9, "ttft": {"mean": text_ttft_mean}, "itl": {"p99": text_itl_p99}},
    }
    if repeated is not None:
        groups["repeated"] = {"num_requests": 5, "ttft": {"mean": repeated}}
        groups["first_seen"] = {"num_requests": 5, "ttft": {"mean": first}}
    return {
        "num_failed": 0,
        "request_throughput": throughput,
        "output_token_throughput": throughput * 64,
        "groups": groups,
    }


SLO = Slo(ttft_ms=200.0, tpot_ms=20.0)


def by_rate_mixed():
    return {
        # (a) saturates near 1.5 req/s; its text requests stall behind encodes.
        "colocated": {1.0: summary(1.0, 100.0, 80.0), 2.0: summary(1.5, 120.0, 90.0, p99_ttft=900.0)},
        "replicas": {1.0: summary(1.0, 50.0, 40.0), 2.0: summary(1.8, 60.0, 50.0, p99_ttft=500.0)},
        "disagg": {1.0: summary(1.0, 20.0, 30.0), 2.0: summary(2.0, 25.0, 60.0)},
    }


def test_target_rate_is_nearest_to_colocated_saturation():
    rate, why = target_rate(by_rate_mixed())
    assert rate == 2.0 and "colocated" in why
    assert target_rate({"disagg": {1.0: summary(0.9, 1, 1)}})[0] == 1.0
    assert target_rate({}) == (None, "no configuration completed a run")


def test_ratios_are_baseline_over_disagg_at_each_rate():
    ratios = ratios_to_disagg(by_rate_mixed())
    assert set(ratios) == {"colocated", "replicas"}
    assert ratios["colocated"]["2"]["itl_p99_text"] == 4.8
    assert ratios["replicas"]["1"]["ttft_mean_text"] == round(40 / 30, 4)
    assert ratios["colocated"]["2"]["ttft_mean_text"] == 1.5
    assert ratios["colocated"]["2"]["request_throughput"] == 0.75
    assert ratios_to_disagg({"colocated": {}}) == {}


def test_mixed_targets_met_and_missed():
    by_rate = by_rate_mixed()
    result = analyze("mixed", by_rate, SLO)
    targets = {t["name"]: t for t in result["targets"]}
    assert targets["p99 ITL of text requests, (c) / (a)"]["met"] is True  # 25/120
    assert targets["p99 ITL of text requests, (c) / (b)"]["met"] is True  # 25/60
    assert targets["mean TTFT of text requests, (c) / (a)"]["met"] is False  # 60/90 > 0.5
    assert targets["mean TTFT of text requests, (c) / (a)"]["value"] == round(60 / 90, 4)
    good = result["goodput"]
    assert good["colocated"]["rate"] == 1.0 and good["disagg"]["rate"] == 2.0 and good["disagg"]["lower_bound"]
    goodput_target = targets["goodput (c) / max((a), (b))"]
    assert goodput_target["value"] == 2.0 and goodput_target["met"] is True and "lower bound" in goodput_target["note"]


def test_targets_without_a_configuration_are_not_measured():
    by_rate = {"disagg": {1.0: summary(1.0, 20.0, 30.0)}}
    targets = evaluate_targets("mixed", by_rate, {"disagg": {"rate": 1.0, "lower_bound": True}}, 1.0)
    assert [t.met for t in targets] == [None, None, None, None]
    assert evaluate_targets("text", by_rate, {}, 1.0) == []


def test_repeat_target_compares_repeated_with_first_seen_images():
    by_rate = {
        "disagg": {1.0: summary(1.0, 20.0, 30.0, repeated=40.0, first=100.0)},
        "colocated": {1.0: summary(1.0, 20.0, 30.0, repeated=80.0, first=100.0)},
    }
    targets = {t.name: t for t in evaluate_targets("repeat", by_rate, {}, 1.0)}
    assert targets["mean TTFT repeated / first-seen images, (c)"].met is True
    assert targets["mean TTFT repeated / first-seen images, (a)"].met is False


def test_goodput_target_without_a_passing_baseline_asks_for_lower_rates():
    by_rate = {"colocated": {1.0: summary(1.0, 1, 1, p99_ttft=900.0)}, "disagg": {1.0: summary(1.0, 1, 1)}}
    targets = evaluate_targets("multi-image", by_rate, analyze("multi-image", by_rate, SLO)["goodput"], 1.0)
    assert targets[0].met is None and "sweep lower rates" in targets[0].note


def test_long_mixed_compares_epd_with_disagg_on_short_text_and_goodput():
    by_rate = {
        "disagg": {1.0: summary(1.0, 200.0, 300.0), 2.0: summary(2.0, 400.0, 500.0, p99_ttft=900.0)},
        "epd": {1.0: summary(1.0, 50.0, 450.0), 2.0: summary(2.0, 60.0, 700.0)},
    }
    result = analyze("long-mixed", by_rate, SLO)
    # Without (a) or (b), the rate is the first configuration's saturation.
    assert result["target_rate"] == 2.0 and "disagg" in result["target_rate_reason"]
    assert result["ratios_to_disagg"]["epd"]["2"]["itl_p99_text"] == 0.15
    targets = {t["name"]: t for t in result["targets"]}
    assert targets["p99 ITL of short text requests, (d) / (c)"]["value"] == 0.15
    assert targets["p99 ITL of short text requests, (d) / (c)"]["met"] is True
    assert targets["mean TTFT of short text requests, (d) / (c)"]["met"] is False  # 700 / 500
    assert targets["p99 TTFT of all requests, (d) / (c)"]["value"] == round(100 / 900, 4)
    assert result["goodput"]["disagg"]["rate"] == 1.0 and result["goodput"]["epd"]["rate"] == 2.0
    assert targets["goodput (d) / (c)"]["value"] == 2.0 and targets["goodput (d) / (c)"]["met"] is True
    only_epd = evaluate_targets("long-mixed", {"epd": by_rate["epd"]}, {"epd": {"rate": 2.0}}, 2.0)
    assert [t.met for t in only_epd] == [None, None, None, None]


def test_report_shows_epd_beside_the_other_configurations():
    from services.bench.serve.report import render_markdown

    by_rate = {
        "disagg": {1.0: summary(1.0, 200.0, 300.0)},
        "epd": {1.0: summary(1.0, 50.0, 450.0)},
    }
    for runs in by_rate.values():
        runs[1.0]["groups"]["long"] = {"num_requests": 2, "ttft": {"mean": 2000.0}}
    results = {
        "command": "epd bench serve",
        "machine": {"cpu": "cpu", "num_cpus": 2, "cores": [0, 1], "platform": "linux", "torch": "2"},
        "model": {"path": "/m", "image_size": 32},
        "workload": {
            "name": "long-mixed",
            "description": "long",
            "num_requests": 10,
            "prompt_words": 8,
            "max_tokens": 4,
            "seed": 0,
            "repeats": 1,
        },
        "rates": [1.0],
        "rates_source": "given",
        "slo": {"ttft_ms": 200.0, "tpot_ms": 20.0, "derivation": "given"},
        "configs": {
            name: {
                "label": label,
                "notes": [],
                "processes": [],
                "error": None,
                "by_rate": {"1": runs[1.0]},
            }
            for (name, runs), label in zip(by_rate.items(), ("(c) E+PD", "(d) E+P+D"))
        },
        "analysis": analyze("long-mixed", by_rate, SLO),
    }
    markdown = render_markdown(results)
    assert "| itl_p99_text | 0.25 |" in markdown and "epd / disagg < 1" in markdown
    assert "| epd | text (short) |" in markdown and "| epd | long |" in markdown
    assert "| epd | 1" in markdown and "goodput (d) / (c)" in markdown

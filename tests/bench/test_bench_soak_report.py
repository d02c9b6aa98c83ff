"""epd bench soak: outcome counting, memory sampling and the pass/fail verdict of its report."""

from __future__ import annotations

import os

from services.bench.soak.report import OUTCOMES, locust_outcomes, markdown, rss_bytes

STATS_HEADER = "Type,Name,Request Count,Failure Count\n"


def _results(*, failed: int = 0, rss_end: int = 102, held: int = 0, restarted: tuple[str, ...] = ()) -> dict:
    outcomes = {**dict.fromkeys(OUTCOMES, 1), "failed": failed}
    outcomes["sent"] = sum(outcomes.values())
    soak = {
        "name": "soak",
        "seconds": 60,
        "outcomes": outcomes,
        "faults": [],
        "restarted": list(restarted),
        "rss_start": {"pd-0": 100, "proxy": 50},
        "rss_end": {"pd-0": rss_end, "proxy": 50},
    }
    faults = {
        "name": "faults",
        "seconds": 30,
        "outcomes": outcomes,
        "restarted": ["pd-1"],
        "rss_start": {},
        "rss_end": {},
        "faults": [{"fault": "SIGKILL pd-1", "exit_code": -9, "recovered_s": 0.2, "rejoined_s": 12.0}],
    }
    return {
        "model": "/models/tiny-v1",
        "topology": "2E+2PD",
        "phases": [faults, soak],
        "max_rss_drift": 0.05,
        "quiescent": {"pd-0": {"reserved_tokens": held, "kv_blocks_used": 0}, "encoder-0": {"pending": 0}},
    }


def test_outcomes_are_read_from_the_locustfile_outcome_rows(tmp_path):
    stats = tmp_path / "run_stats.csv"
    stats.write_text(
        STATS_HEADER + "POST,chat text,9,0\nOUTCOME,succeeded,7,0\nOUTCOME,failed,2,0\n"
        "OUTCOME,unknown,5,0\n,Aggregated,18,0\n"
    )
    counts = locust_outcomes(stats)
    assert counts["succeeded"] == 7 and counts["failed"] == 2 and counts["rejected"] == 0
    assert counts["sent"] == 9
    assert locust_outcomes(tmp_path / "missing.csv")["sent"] == 0


def test_rss_is_read_for_a_live_process_and_none_for_a_gone_one():
    assert rss_bytes(os.getpid()) > 0
    assert rss_bytes(2**22 + 12345) is None


def test_a_clean_run_passes_and_lists_every_fault():
    report, ok = markdown(_results())
    assert ok
    assert "| SIGKILL pd-1 | -9 | 0.2 | 12.0 |" in report
    assert "| pd-0 | " in report and "+2.0%" in report
    assert "Result: PASS" in report


def test_failures_leaks_restarts_and_memory_growth_each_fail_the_run():
    for broken in (_results(failed=1), _results(held=16), _results(rss_end=106), _results(restarted=("pd-0",))):
        report, ok = markdown(broken)
        assert not ok
        assert "Result: FAIL" in report

"""``epd bench slo``: its summary and report from hand-made records, and one real burst on the tiny model.

The end-to-end run proves the harness (``epd up`` started and stopped per
configuration, every request answered, the report written), not
performance: no timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.bench import slo
from services.bench.serve.stats import RequestRecord


def record(index: int, kind: str, token_times: list[float], start: float = 0.0) -> RequestRecord:
    r = RequestRecord(index=index, kind=kind, num_images=4 if kind == "image" else 0, image_class=None, scheduled_s=0)
    r.start_s, r.token_times_s, r.end_s = start, token_times, (token_times[-1] if token_times else None)
    return r


def test_summary_counts_tokens_over_the_run_and_splits_text_from_images():
    records = [
        record(0, "text", [0.5, 0.6, 0.8]),
        record(1, "image", [1.0, 1.1, 1.2], start=1.0),  # ends 2.2 s into the run
        record(2, "text", []),  # failed: no tokens
    ]
    records[2].error = "HTTP 503"
    summary = slo._summary(records, wall_s=3.0)
    assert summary["num_ok"] == 2 and summary["tokens"] == 6
    assert summary["tokens_per_s"] == round(6 / 2.2, 2)  # tokens over the time the last request ended
    assert summary["text"]["count"] == 1 and summary["text"]["ttft_mean_ms"] == 500.0
    assert summary["image"]["itl_median_ms"] == pytest.approx(100.0)


def test_the_report_names_each_goal_and_ratio():
    burst = {
        "workload": "burst",
        "configs": {
            "default": {"label": "epd up", "num_ok": 2, "num_requests": 2, "tokens_per_s": 90.0, "all": {}},
            "fixed": {"label": "epd up fixed", "num_ok": 2, "num_requests": 2, "tokens_per_s": 100.0, "all": {}},
        },
        "hf_generate": {"num_requests": 1, "tokens_per_s": 30.0},
    }
    text = slo._markdown(burst)
    assert "default / generate(): 3.00x (goal >= 3)" in text and "default / fixed budget: 0.90x" in text
    group = {"ttft_mean_ms": 100.0, "itl_p99_ms": 50.0}
    mixed = {
        "workload": "mixed",
        "configs": {
            "disagg": {"label": "a", "num_ok": 1, "num_requests": 1, "tokens_per_s": 1.0, "text": group},
            "colocated": {"label": "b", "num_ok": 1, "num_requests": 1, "tokens_per_s": 1.0, "text": group},
        },
    }
    assert "p99 text ITL, disagg / colocated: 1.00 (goal <= 0.25)" in slo._markdown(mixed)


@pytest.mark.e2e
def test_a_burst_on_the_tiny_model_writes_its_report(tiny_model_dir, tmp_path):
    out = tmp_path / "slo"
    command = [sys.executable, "-m", "services.cli", "bench", "slo", "--model", str(tiny_model_dir)]
    command += ["--num-requests", "4", "--max-tokens", "4", "--hf-requests", "1", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    for config in results["configs"].values():
        assert config["num_ok"] == config["num_requests"] == 4 and config["tokens"] == 16
    assert results["hf_generate"]["tokens"] == 4
    assert "default / fixed budget" in (out / "results.md").read_text()

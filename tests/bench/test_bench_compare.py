"""``epd bench compare``: its seeded workloads, and one real run of ``epd up`` beside a peer that never starts.

The end-to-end run proves the harness (the server started and stopped, every
request answered, the first requests after ready logged, a peer that exits
before it answers recorded without stopping the rest), not performance: no
timing is asserted.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from services.bench.compare import report, workloads
from services.bench.serve.stats import RequestRecord


@pytest.mark.parametrize(
    ("name", "text", "image"),
    [
        ("burst", 32, 0),
        ("image-burst", 0, 16),
        ("burst-16", 16, 0),
        ("burst-16-images", 12, 4),
        ("burst-64-images", 48, 16),
    ],
)
def test_burst_workloads_send_their_kinds_at_once(name, text, image):
    requests = workloads.build(workloads.WORKLOADS[name], seed=0)
    kinds = [r.kind for r in requests]
    assert (kinds.count("text"), kinds.count("image")) == (text, image)
    assert all(r.arrival_s == 0.0 for r in requests)


def test_workloads_are_a_function_of_the_seed_alone():
    mixed = workloads.WORKLOADS["mixed"]
    first, again, other = (workloads.build(mixed, seed) for seed in (0, 0, 1))
    assert workloads.encode(first, "m") == workloads.encode(again, "m")
    assert workloads.encode(first, "m") != workloads.encode(other, "m")
    assert {r.kind for r in first} == {"text", "image"}
    assert all(r.body["ignore_eos"] and r.body["temperature"] == 0.0 for r in first)


def _record(index: int, kind: str, stages: dict[str, float]) -> RequestRecord:
    record = RequestRecord(index=index, kind=kind, num_images=int(kind == "image"), image_class=None, scheduled_s=0.0)
    record.token_times_s, record.end_s, record.stages_ms = [0.5, 0.6], 0.6, stages
    return record


def test_stage_medians_are_reported_per_kind_for_servers_that_give_them():
    ours = [
        _record(0, "image", {"encode": 100.0, "first_token": 400.0}),
        _record(1, "image", {"encode": 300.0, "first_token": 600.0}),
        _record(2, "text", {"queue": 10.0}),
    ]
    peer = [_record(i, r.kind, {}) for i, r in enumerate(ours)]
    summary, peer_summary = report.summarize(ours), report.summarize(peer)
    assert summary["image"]["stages_ms"] == {"encode": 200.0, "first_token": 500.0}
    assert summary["text"]["stages_ms"] == {"queue": 10.0}
    assert "stages_ms" not in peer_summary["image"]
    results = {
        "model": "m",
        "command": "epd bench compare",
        "servers": ["up", "vllm"],
        "targets": {"up": {"label": "epd up", "peer": False}, "vllm": {"label": "vLLM", "peer": True}},
        "runs": 1,
        "ratio_to": "vllm",
        "workloads": {"mixed": {"up": [summary], "vllm": [peer_summary]}},
        "workload_descriptions": {"mixed": "both kinds"},
        "token_check": {"mixed": report.check_tokens({"up": [report.token_counts(ours)]})},
    }
    rows = [line for line in report.render(results).splitlines() if line.startswith("| up |")]
    assert rows == [
        "| up | text | 500 | – | – | – | – | 10 | – | – | – |",
        "| up | image | 500 | – | – | – | 200 | – | – | – | 500 |",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_run_beside_a_peer_that_never_starts_reports_what_ran_and_what_failed(tiny_model_dir, tmp_path):
    out = tmp_path / "compare"
    command = [sys.executable, "-m", "services.cli", "bench", "compare", "--model", str(tiny_model_dir)]
    command += ["--configs", "colocated", "--runs", "1", "--workloads", "burst-16-images", "--scale", "0.25"]
    command += ["--peer", f"gone=http://127.0.0.1:{_free_port()}", "--peer-start", "gone=exit 3"]
    command += ["--ratio-to", "gone", "--ready-timeout", "60", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    (summary,) = results["workloads"]["burst-16-images"]["colocated"]
    assert summary["num_ok"] == summary["num_requests"] == 4  # 3 text + 1 image at a quarter of the scale
    assert results["workloads"]["burst-16-images"]["gone"] == []
    assert "exited with code 3" in results["start_failures"]["gone"][0]
    logged = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    first = [r for r in logged if r["workload"] == "first-after-ready"]
    assert sorted(r["kind"] for r in first) == ["image", "text"] and all(r["token_times_s"] for r in first)
    assert "burst-16-images" in (out / "results.md").read_text()
    images = [r for r in logged if r["workload"] == "burst-16-images" and r["kind"] == "image"]
    assert images and all(r["stages_ms"]["first_token"] > 0 for r in images)  # the proxy's usage.epd timings
    assert "Where the first token's time went" in (out / "results.md").read_text()

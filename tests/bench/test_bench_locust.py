"""load/locustfile.py: a bounded headless Locust run against a real cluster, zero failures, TTFT and ITL reported.

Skipped when Locust is not installed (``pip install 'epd-cluster[bench]'``).
Locust runs in its own process: importing it here would monkey-patch this
one with gevent.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_support import InProcessCluster

pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed")

LOCUSTFILE = Path(__file__).resolve().parents[2] / "load" / "locustfile.py"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    started = InProcessCluster(str(tiny_model_dir)).start()
    try:
        yield started
    finally:
        started.stop()


def test_headless_locust_run_has_no_failures_and_reports_ttft_and_itl(cluster, tmp_path):
    host = cluster.base_url.removesuffix("/v1")
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        "5",
        "-r",
        "5",
        "-t",
        "5s",
        "--host",
        host,
        "--image-size",
        "32",
        "--max-tokens",
        "6",
        "--think-time",
        "0.1",
        "--csv",
        str(tmp_path / "run"),
        "--stop-timeout",
        "10",
    ]
    # One user of each kind; other settings from the environment must not leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "LOCUST_"))}
    env.update(
        EPD_LOAD_TEXT_WEIGHT="1",
        EPD_LOAD_IMAGE_WEIGHT="1",
        EPD_LOAD_REPEAT_WEIGHT="1",
        EPD_LOAD_DISCONNECT_WEIGHT="1",
        EPD_LOAD_INVALID_WEIGHT="1",
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Response time percentiles" in output

    with open(tmp_path / "run_stats.csv") as file:
        rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(file)}
    assert all(int(row["Failure Count"]) == 0 for row in rows.values())
    for kind in ("text", "image", "repeated-image"):
        for metric in ("TTFT", "ITL", "E2E"):
            assert int(rows[(metric, kind)]["Request Count"]) > 0, (metric, kind)
        assert int(rows[("POST", f"chat {kind}")]["Request Count"]) > 0
    assert float(rows[("TTFT", "text")]["99%"]) > 0
    # Hang-ups and bad inputs were sent, and each ended the way it should.
    assert int(rows[("OUTCOME", "disconnected")]["Request Count"]) > 0
    assert int(rows[("OUTCOME", "bad-input-rejected")]["Request Count"]) > 0
    assert ("OUTCOME", "failed") not in rows
    assert cluster.leaks() == {}

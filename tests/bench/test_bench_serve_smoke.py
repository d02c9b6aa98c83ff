"""``epd bench serve`` end to end on the tiny model: real processes, pinned, one short rate, every output file.

Proves the harness, not performance: two configurations (colocated, PD with
``--encoder local``, and disaggregated; the replicas layout differs only in
placement, covered by the layout and client tests), six requests, four
tokens each. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from services.bench.serve.workload import make_requests

pytestmark = pytest.mark.e2e


def seed_with_kinds(workload: str, count: int, kinds: set[str]) -> int:
    """The first seed whose ``workload`` run of ``count`` requests has every one of ``kinds`` (so each is reported)."""
    for seed in range(1000):
        specs = make_requests(workload, count, seed=seed, run=0, image_size=32, prompt_words=8)
        if {s.kind for s in specs} == kinds:
            return seed
    raise AssertionError("no such seed")


def test_bench_serve_writes_json_markdown_and_plots(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    seed = seed_with_kinds("mixed", 6, {"text", "image"})
    # Two cores and 1 encoder + 1 PD whatever the machine has (its default layout scales with the cores).
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("the disaggregated layout needs two cores")
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "bench",
        "serve",
        "--model",
        str(tiny_model_dir),
        "--workload",
        "mixed",
        "--configs",
        "colocated,disagg",
        "--rates",
        "6",
        "--num-requests",
        "6",
        "--max-tokens",
        "4",
        "--prompt-words",
        "8",
        "--seed",
        str(seed),
        "--calibration-requests",
        "1",
        "--startup-timeout",
        "120",
        "--request-timeout",
        "60",
        "--cores",
        ",".join(map(str, cores)),
        "--encoders",
        "1",
        "--pds",
        "1",
        "--out",
        str(out),
        "--no-progress",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "## Goodput" in done.stdout

    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == "epd-bench-serve/1"
    assert results["rates"] == [6.0] and results["workload"]["seed"] == seed
    assert results["slo"]["ttft_ms"] > 0 and "Derived on colocated" in results["slo"]["derivation"]
    assert results["calibration"]["config"] == "colocated"
    for name, num_processes in (("colocated", 2), ("disagg", 3)):
        config = results["configs"][name]
        assert config["error"] is None
        assert len(config["processes"]) == num_processes
        for process in config["processes"]:
            assert process["measured_affinity"] == process["cores"] and process["threads"] >= 1
        summary = config["by_rate"]["6"]
        assert summary["num_ok"] == 6 and summary["num_failed"] == 0
        assert {"all", "text", "image"} <= set(summary["groups"])
        for metric in ("ttft", "tpot", "itl", "e2e"):
            assert summary["groups"]["all"][metric]["p99"] is not None
        assert summary["request_throughput"] > 0
    analysis = results["analysis"]
    assert analysis["target_rate"] == 6.0
    assert set(analysis["goodput"]) == {"colocated", "disagg"}
    assert analysis["ratios_to_disagg"]["colocated"]["6"]["itl_p99_text"] is not None
    assert [t["name"] for t in analysis["targets"]][-1] == "goodput (c) / max((a), (b))"

    markdown = (out / "results.md").read_text()
    for heading in ("## Configurations", "## Results per rate", "## Ratios to (c)", "## Goodput", "## Targets"):
        assert heading in markdown
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 12 and all(json.loads(line)["error"] is None for line in lines)
    assert len(list((out / "logs").glob("*.log"))) == 5
    if importlib.util.find_spec("matplotlib") is None:
        assert results["plots"] == {}
    else:
        assert sorted(results["plots"].values()) == ["cdf-mixed.png", "rates-mixed.png"]
        for name in results["plots"].values():
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_runs_epd_beside_disagg_on_the_long_mixed_workload(tiny_model_dir, tmp_path):
    """(d) E+P+D end to end on two cores: prefill PD + encoder on one, decode PD on the other, compared with (c)."""
    out = tmp_path / "out"
    seed = seed_with_kinds("long-mixed", 8, {"text", "long", "image"})
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("the E+P+D layout needs two cores")
    command = [
        *(sys.executable, "-m", "services.cli", "bench", "serve", "--model", str(tiny_model_dir)),
        *("--workload", "long-mixed", "--configs", "disagg,epd", "--encoder-placement", "shared"),
        *("--encoder-threads", "1", "--rates", "4", "--num-requests", "8", "--max-tokens", "4"),
        # tiny has 2048 positions and ~2.8 tokens a word: short long prompts keep the test quick.
        *("--prompt-words", "8", "--long-prompt-words", "100,200", "--seed", str(seed)),
        *("--calibration-requests", "1", "--startup-timeout", "120", "--request-timeout", "60"),
        *("--cores", ",".join(map(str, cores)), "--out", str(out), "--no-progress", "--no-plots"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]

    results = json.loads((out / "results.json").read_text())
    assert results["workload"]["long_prompt_words"] == [100, 200]
    epd = results["configs"]["epd"]
    assert epd["error"] is None and epd["label"].startswith("(d) E+P+D: 1E + 1P + 1D on 2 cores")
    processes = {p["name"]: p for p in epd["processes"]}
    assert [processes[n]["pd_role"] for n in ("prefill-0", "decode-0")] == ["prefill", "decode"]
    assert processes["decode-0"]["measured_affinity"] == [cores[1]]
    assert processes["encoder-0"]["measured_affinity"] == processes["prefill-0"]["measured_affinity"] == [cores[0]]
    proxy_argv = processes["proxy-0"]["argv"]
    assert proxy_argv[proxy_argv.index("--decode") + 1] == processes["decode-0"]["address"]
    for name in ("disagg", "epd"):
        summary = results["configs"][name]["by_rate"]["4"]
        assert summary["num_ok"] == 8 and summary["num_failed"] == 0
        assert {"all", "text", "long", "image"} <= set(summary["groups"])
    analysis = results["analysis"]
    assert set(analysis["goodput"]) == {"disagg", "epd"}
    assert analysis["ratios_to_disagg"]["epd"]["4"]["itl_p99_text"] is not None
    # No timing is asserted: the goodput ratio needs (c) to meet the SLO, which a busy machine may not allow.
    targets = analysis["targets"]
    assert [t["name"] for t in targets][-1] == "goodput (d) / (c)"
    assert all(t["value"] is not None for t in targets[:-1])
    assert "| epd | text (short) |" in (out / "results.md").read_text()

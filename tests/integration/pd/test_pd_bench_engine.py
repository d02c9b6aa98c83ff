"""``epd bench engine`` end to end in a tiny configuration: every system and the TTFT pair."""

from __future__ import annotations

import json

import pytest
import torch

from services import cli
from services.bench.engine.command import HF_SYSTEMS


def test_bench_engine_runs_every_system_and_the_prefix_cache_experiment(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "engine", "--model", str(tiny_model_dir), "--quick", "--repeat", "2", "--json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"engine", "engine_torch_linear", "generate_batch", "generate", "static"}
    for name, result in results.items():
        assert result["num_tokens"] == 8 * 16, name  # every request generated exactly --output-len
        assert len(result["seconds"]) == 2 and result["tokens_per_s"] > 0
    [first_pair, second_pair] = report["prefix_cache_ttft"]
    for pair in (first_pair, second_pair):
        assert pair["first"]["preallocate"] == "RESERVED" and pair["first"]["cached_tokens"] == 0
        assert pair["repeat"]["preallocate"] == "READY" and pair["repeat"]["via_prefix_cache"]
        assert pair["repeat"]["cached_tokens"] >= pair["prompt_tokens"] - 16
    table = capsys.readouterr().out
    assert "| engine |" in table and "| static |" in table and "TTFT first" in table
    # Greedy outputs agree with generate() (the random prompts hold no near-ties for the tiny model).
    assert "| engine | 8 | 128 |" in table and "8/8 |" in table


def test_bench_engine_runs_every_system_on_the_asked_device_and_dtype(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "engine",
        "--model",
        str(tiny_model_dir),
        "--quick",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--skip",
        "generate",
        "--skip",
        "engine_torch_linear",
        "--skip",
        "ttft",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["machine"]["device"] == "cpu" and report["machine"]["dtype"] == "bfloat16"
    assert {name: result["num_tokens"] for name, result in report["results"].items()} == {
        "engine": 8 * 16,
        "generate_batch": 8 * 16,
        "static": 8 * 16,
    }


def test_bench_engine_refuses_a_device_this_machine_lacks(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA is not available"):
        cli.main(["bench", "engine", "--model", str(tiny_model_dir), "--quick", "--device", "cuda"])


def test_bench_engine_measures_structured_outputs_beside_the_free_engine(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "engine", "--model", str(tiny_model_dir), "--quick", "--structured-share", "0.5", "--json"]
    argv += [str(out)] + [arg for name in ("engine_torch_linear", *HF_SYSTEMS, "ttft") for arg in ("--skip", name)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    # Constrained requests still generate exactly --output-len tokens: the two rows compare like for like.
    assert {name: r["num_tokens"] for name, r in report["results"].items()} == {
        "engine": 8 * 16,
        "engine_structured": 8 * 16,
    }
    assert report["machine"]["structured_share"] == 0.5
    assert "structured outputs on 50% of the requests: " in capsys.readouterr().out


def test_bench_engine_refuses_a_share_outside_zero_to_one(tiny_model_dir):
    with pytest.raises(SystemExit, match="structured-share"):
        cli.main(["bench", "engine", "--model", str(tiny_model_dir), "--quick", "--structured-share", "1.5"])

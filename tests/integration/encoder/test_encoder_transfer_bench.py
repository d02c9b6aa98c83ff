"""``epd bench transfer`` runs end to end in a tiny configuration and reports its numbers."""

from __future__ import annotations

import json

import pytest

from services import cli
from services.bench import transfer


def test_summary_percentiles_and_throughput() -> None:
    seconds = [0.001 * i for i in range(1, 101)]  # 1..100 ms
    summary = transfer.summarize(seconds, num_bytes=5_000_000)
    assert summary["p50_ms"] == pytest.approx(50.5)
    assert summary["p99_ms"] == pytest.approx(99.0)
    assert summary["min_ms"] == pytest.approx(1.0)
    assert summary["gb_per_s_at_p50"] == pytest.approx(5_000_000 / 0.0505 / 1e9)


def test_bench_transfer_pushes_one_llava_image_through_pd(tmp_path, capsys) -> None:
    out = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--iterations", "3", "--warmup", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["shape"] == [576, 4096] and result["dtype"] == "float16"
    assert result["num_bytes"] == 576 * 4096 * 2 and result["iterations"] == 3
    assert 0 < result["min_ms"] <= result["p50_ms"] <= result["p99_ms"]
    assert result["gb_per_s_at_p50"] > 0
    assert "p50 ms" in capsys.readouterr().out


def test_bench_transfer_rejects_bad_arguments() -> None:
    assert cli.main(["bench", "transfer", "--chunk-kib", "2048"]) == 2


def test_bench_transfer_kv_rows_compare_the_push_with_the_prefill(tmp_path, tiny_model_dir) -> None:
    out = tmp_path / "kv.json"
    argv = ["bench", "transfer", "--kv", "--kv-model", str(tiny_model_dir), "--kv-tokens", "64,256"]
    assert cli.main([*argv, "--kv-repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [64, 256]
    assert rows[0]["kv_mb"] < rows[1]["kv_mb"]
    assert all(row["push_ms"] > 0 and row["prefill_ms"] > 0 for row in rows)


def test_bench_transfer_kv_rejects_bad_lengths() -> None:
    assert cli.main(["bench", "transfer", "--kv", "--kv-tokens", "x"]) == 2
    assert cli.main(["bench", "transfer", "--kv", "--kv-repeats", "0"]) == 2

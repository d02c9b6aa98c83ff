"""``epd bench linear``: every backend runs in its own process and is reported; bad flags are refused."""

from __future__ import annotations

import argparse

import pytest

from services.bench import linear
from services.common.cpu_linear import onednn_works


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    linear.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.skipif(not onednn_works(), reason="this PyTorch build has no oneDNN linear")
def test_reports_every_backend_against_torch(capsys):
    assert linear.run(_args("--iterations", "3", "--warmup", "1", "--max-rows", "20")) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {line.split("|")[1].strip(): line for line in table[2:]}
    assert set(rows) == set(linear.BACKENDS)
    assert "1.00x faster" in rows["torch"]


@pytest.mark.parametrize("argv", [("--backends", "blas"), ("--iterations", "0"), ("--max-rows", "0")])
def test_bad_flags_are_refused(argv, capsys):
    assert linear.run(_args(*argv)) == 2
    assert "epd bench linear:" in capsys.readouterr().err

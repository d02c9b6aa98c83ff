"""``epd pd`` flags reach PdConfig; PdConfig refuses impossible limits."""

from __future__ import annotations

import argparse

import pytest

from services.pd import main as pd_main
from services.pd.config import PdConfig


def _config(argv: list[str]) -> PdConfig:
    parser = argparse.ArgumentParser()
    pd_main.add_arguments(parser)
    return pd_main.config_from_args(parser.parse_args(argv))


def test_waiting_bound_and_stall_timeout_flags():
    default = _config([])
    assert default.max_waiting_tokens == 262144 and default.stall_timeout_s == 60.0
    config = _config(["--max-waiting-tokens", "77", "--stall-timeout-s", "0"])
    assert config.max_waiting_tokens == 77 and config.stall_timeout_s == 0.0


def test_linear_backend_flag():
    assert _config([]).linear_backend == "auto"
    assert _config(["--linear-backend", "torch"]).linear_backend == "torch"


def test_waiting_bound_flag_reads_the_environment(monkeypatch):
    monkeypatch.setenv("EPD_MAX_WAITING_TOKENS", "123")
    assert _config([]).max_waiting_tokens == 123


@pytest.mark.parametrize("field, value", [
    ("max_waiting_tokens", 0), ("max_waiting_requests", 0), ("waiting_retry_after_ms", 0), ("stall_timeout_s", -1.0),
    ("linear_backend", "blas"),
])
def test_impossible_limits_are_refused(field, value):
    with pytest.raises(ValueError):
        PdConfig(model="", **{field: value})

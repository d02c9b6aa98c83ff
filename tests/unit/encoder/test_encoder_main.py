"""Encoder entry point: flags -> config, env overrides, invalid config."""

from __future__ import annotations

import argparse
import os

import pytest

from services.encoder import main
from services.encoder.config import DEFAULT_METRICS_PORT, MIB, EncoderConfig


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(argv)


def _help() -> str:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.format_help()


def test_flag_defaults_match_config_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [key for key in os.environ if key.startswith("EPD_")]:
        monkeypatch.delenv(name)
    # The one intended difference: /metrics is off in code and on (9101) for `epd encoder`.
    assert main.config_from_args(parse([])) == EncoderConfig(metrics_port=DEFAULT_METRICS_PORT)


def test_flags_and_env_build_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_MAX_BATCH_IMAGES", "3")
    config = main.config_from_args(parse(["--port", "0", "--cache-mib", "4", "--no-warmup", "--push-chunk-kib", "512"]))
    assert config.max_batch_images == 3
    assert config.port == 0 and config.cache_bytes == 4 * MIB and not config.warmup
    assert config.push_chunk_bytes == 512 * 1024
    monkeypatch.setenv("EPD_MAX_MESSAGE_MIB", "8")
    assert main.config_from_args(parse([])).max_message_bytes == 8 * MIB
    assert "--max-message-mib" in _help()
    monkeypatch.setenv("EPD_LINEAR_BACKEND", "torch")
    assert main.config_from_args(parse([])).linear_backend == "torch"
    assert main.config_from_args(parse(["--linear-backend", "kernel"])).linear_backend == "kernel"


def test_invalid_config_exits_with_2() -> None:
    assert main.run(parse(["--push-chunk-kib", "2048"])) == 2
    assert main.run(parse(["--max-batch-images", "0"])) == 2
    assert main.run(parse(["--max-message-mib", "0"])) == 2


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        EncoderConfig(max_pending=0)
    with pytest.raises(ValueError):
        EncoderConfig(max_wait_ms=-1)
    with pytest.raises(ValueError, match="linear_backend"):
        EncoderConfig(linear_backend="mkl")


def test_pd_allow_builds_the_allow_list_and_a_bad_entry_exits_with_2() -> None:
    config = main.config_from_args(parse(["--pd-allow", "pd-0:50061, 10.0.0.7:50061,[::1]:7"]))
    assert config.pd_allow.entries == (("pd-0", 50061), ("10.0.0.7", 50061), ("::1", 7))
    assert main.config_from_args(parse(["--pd-allow", "*"])).pd_allow.any
    for bad in ("pd-0", "pd-0:0", "::1:7", "*,pd-0:1"):
        assert main.run(parse(["--pd-allow", bad])) == 2

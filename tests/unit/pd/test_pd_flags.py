"""``epd pd`` flags reach PdConfig; PdConfig refuses impossible limits."""

from __future__ import annotations

import argparse

import pytest

from services.common.video_files import VideoLimits
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


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_waiting_tokens", 0),
        ("max_waiting_requests", 0),
        ("waiting_retry_after_ms", 0),
        ("stall_timeout_s", -1.0),
        ("linear_backend", "blas"),
        ("max_kv_push_buffer_mb", 0),
        ("max_kv_reservation_share", 0.0),
        ("max_kv_reservation_share", 1.5),
        ("grammar_compile_timeout_s", 0.0),
        ("grammar_compile_timeout_s", float("inf")),
        ("max_pending_grammar_compiles", 0),
        ("grammar_cache_mb", 0),
    ],
)
def test_impossible_limits_are_refused(field, value):
    with pytest.raises(ValueError):
        PdConfig(model="", **{field: value})


def test_slo_itl_flag_takes_auto_zero_or_milliseconds(monkeypatch):
    default = _config([])
    assert default.slo_itl_ms is None and default.min_prefill_tokens == 16  # auto
    assert _config(["--slo-itl-ms", "0"]).slo_itl_ms == 0.0  # off
    assert _config(["--slo-itl-ms", "AUTO"]).slo_itl_ms is None
    config = _config(["--slo-itl-ms", "45.5", "--min-prefill-tokens", "32"])
    assert config.slo_itl_ms == 45.5 and config.min_prefill_tokens == 32
    monkeypatch.setenv("EPD_SLO_ITL_MS", "0")
    assert _config([]).slo_itl_ms == 0.0


def test_target_itl_is_an_alias_of_slo_itl(monkeypatch):
    assert _config(["--target-itl-ms", "0"]).slo_itl_ms == 0.0
    assert _config(["--target-itl-ms", "12"]).slo_itl_ms == 12.0
    monkeypatch.setenv("EPD_TARGET_ITL_MS", "0")
    assert _config([]).slo_itl_ms == 0.0
    monkeypatch.setenv("EPD_SLO_ITL_MS", "7")  # the new name wins over the old one
    assert _config([]).slo_itl_ms == 7.0


def test_slo_ttft_flag_takes_auto_zero_or_milliseconds(monkeypatch):
    assert _config([]).slo_ttft_ms is None  # auto
    assert _config(["--slo-ttft-ms", "0"]).slo_ttft_ms == 0.0  # off
    assert _config(["--slo-ttft-ms", "1500"]).slo_ttft_ms == 1500.0
    monkeypatch.setenv("EPD_SLO_TTFT_MS", "250")
    assert _config([]).slo_ttft_ms == 250.0


@pytest.mark.parametrize("flag", ["--slo-itl-ms", "--target-itl-ms", "--slo-ttft-ms"])
@pytest.mark.parametrize("value", ["-1", "fast", "inf", "nan"])
def test_bad_slo_values_are_usage_errors(flag, value, capsys):
    with pytest.raises(SystemExit):
        _config([flag, value])
    assert flag.split("-ms")[0][:6] in capsys.readouterr().err


@pytest.mark.parametrize(
    "field, value",
    [
        ("slo_itl_ms", -5.0),
        ("slo_itl_ms", float("inf")),
        ("slo_ttft_ms", -1.0),
        ("slo_ttft_ms", float("nan")),
        ("min_prefill_tokens", 0),
        ("image_hold_s", -1.0),
        ("image_hold_s", float("nan")),
        ("image_hold_s", 601.0),
    ],
)
def test_impossible_budget_settings_are_refused(field, value):
    with pytest.raises(ValueError):
        PdConfig(model="", **{field: value})


def test_image_hold_flag_takes_seconds_and_zero_turns_it_off(monkeypatch):
    assert _config([]).image_hold_s == 6.0
    assert _config(["--image-hold-s", "0"]).image_hold_s == 0.0
    monkeypatch.setenv("EPD_IMAGE_HOLD_S", "2.5")
    assert _config([]).image_hold_s == 2.5
    with pytest.raises(SystemExit):
        _config(["--image-hold-s", "soon"])


def test_role_flag_defaults_to_both():
    assert _config([]).role == "both"
    assert _config(["--role", "decode"]).role == "decode"
    with pytest.raises(SystemExit):
        _config(["--role", "neither"])
    with pytest.raises(ValueError):
        PdConfig(model="m", role="neither")
    with pytest.raises(ValueError):
        PdConfig(model="m", role="decode", encoder="local")


def test_decode_allow_flag():
    assert _config([]).decode_allow.entries == () and not _config([]).decode_allow.any
    config = _config(["--decode-allow", "d0:21063,10.0.0.9:21064"])
    assert config.decode_allow.entries == (("d0", 21063), ("10.0.0.9", 21064))
    assert _config(["--decode-allow", "*"]).decode_allow.any
    with pytest.raises(ValueError, match="--decode-allow"):
        _config(["--decode-allow", "*,d0:1"])


def test_kv_hand_off_limit_flags():
    default = _config([])
    assert default.max_kv_push_buffer_mb == 2048 and default.max_kv_reservation_share == 0.5
    config = _config(["--max-kv-push-buffer-mb", "64", "--max-kv-reservation-share", "0.25"])
    assert config.max_kv_push_buffer_mb == 64 and config.max_kv_reservation_share == 0.25


def test_grammar_compile_flags():
    default = _config([])
    assert default.grammar_compile_timeout_s == 5.0 and default.max_pending_grammar_compiles == 32
    assert default.grammar_cache_mb == 256
    config = _config(
        ["--grammar-compile-timeout-s", "2.5", "--max-pending-grammar-compiles", "4", "--grammar-cache-mb", "64"]
    )
    assert config.grammar_compile_timeout_s == 2.5 and config.max_pending_grammar_compiles == 4
    assert config.grammar_cache_mb == 64


def test_a_colocated_pd_takes_the_proxys_video_limits():
    parser = argparse.ArgumentParser()
    pd_main.add_arguments(parser)
    defaults = pd_main.config_from_args(parser.parse_args([]))
    assert defaults.video_limits() == VideoLimits()  # the proxy's and the encoder's defaults
    args = ["--encoder", "local", "--max-video-frames", "128", "--max-video-seconds", "60", "--max-video-bytes", "1024"]
    limits = pd_main.config_from_args(parser.parse_args(args)).video_limits()
    assert (limits.max_frames, limits.max_seconds, limits.max_bytes) == (128, 60.0, 1024)
    with pytest.raises(ValueError):
        pd_main.config_from_args(parser.parse_args(["--max-video-frames", "0"]))

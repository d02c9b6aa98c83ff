"""Colocated mode's switches: ``epd pd --encoder local`` and ``epd up --colocated``."""

from __future__ import annotations

import argparse

import pytest

from services.launcher import command as up
from services.pd import main as pd_main
from services.pd.config import PdConfig


def _parse(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_pd_encoder_flag_builds_the_config() -> None:
    assert pd_main.config_from_args(_parse(pd_main.add_arguments, [])).encoder == "remote"
    assert pd_main.config_from_args(_parse(pd_main.add_arguments, ["--encoder", "local"])).encoder == "local"
    with pytest.raises(SystemExit):
        _parse(pd_main.add_arguments, ["--encoder", "elsewhere"])
    with pytest.raises(ValueError):
        PdConfig(model="", encoder="elsewhere")


def _children(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, list[str]]:
    specs = up.service_specs(_parse(up.add_arguments, argv))
    return {spec.name: list(spec.argv) for spec in specs}


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_up_colocated_starts_one_pd_with_the_vision_tower_and_no_encoders(monkeypatch: pytest.MonkeyPatch) -> None:
    spawned = _children(monkeypatch, ["--colocated", "--encoders", "3", "--pd-base-port", "6100"])
    assert sorted(spawned) == ["pd-0", "proxy"]
    assert _flag(spawned["pd-0"], "--encoder") == "local"
    assert _flag(spawned["proxy"], "--pd") == _flag(spawned["proxy"], "--encoder") == "127.0.0.1:6100"


def test_up_disaggregated_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    spawned = _children(monkeypatch, ["--encoders", "2"])
    assert sorted(spawned) == ["encoder-0", "encoder-1", "pd-0", "proxy"]
    assert "--encoder" not in spawned["pd-0"]


def test_up_colocated_refuses_several_pds() -> None:
    assert up.run(_parse(up.add_arguments, ["--colocated", "--pds", "2"])) == 2

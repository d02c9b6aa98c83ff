"""Test-only fault switches: parsing, what each does to a push, and the ``--fault`` flag."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from services.encoder import main
from services.encoder.faults import EXTRA_CHUNK, NO_FAULTS, Faults


def test_no_faults_by_default() -> None:
    assert not NO_FAULTS.enabled and Faults.parse("") == NO_FAULTS and Faults.parse(" , ") == NO_FAULTS
    embedding = torch.ones(4, 8)
    assert NO_FAULTS.tamper(embedding) is embedding
    assert NO_FAULTS.extra_chunks() == ()


def test_parse_each_fault_and_combinations() -> None:
    assert Faults.parse("never-push") == Faults(never_push=True)
    assert Faults.parse("push-late-ms=250") == Faults(push_late_ms=250)
    assert Faults.parse("wrong-shape, wrong-dtype,extra-chunk") == Faults(
        wrong_shape=True, wrong_dtype=True, extra_chunk=True
    )
    faults = Faults.parse("extra-chunk,push-late-ms=5")
    assert faults.enabled and Faults.parse(faults.describe()) == faults


@pytest.mark.parametrize("spec", ["nope", "never-push=1", "push-late-ms", "push-late-ms=soon", "push-late-ms=-1"])
def test_parse_rejects_unknown_or_malformed(spec: str) -> None:
    with pytest.raises(ValueError):
        Faults.parse(spec)


def test_tamper_and_extra_chunk() -> None:
    embedding = torch.randn(5, 8)
    assert Faults(wrong_shape=True).tamper(embedding).shape == (4, 8)
    assert Faults(wrong_dtype=True).tamper(embedding).dtype == torch.uint8
    assert Faults(extra_chunk=True).extra_chunks() == (EXTRA_CHUNK,)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(argv)


def test_fault_flag_and_env_build_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [key for key in os.environ if key.startswith("EPD_")]:
        monkeypatch.delenv(name)
    assert main.config_from_args(_parse([])).faults == NO_FAULTS
    assert main.config_from_args(_parse(["--fault", "wrong-shape"])).faults == Faults(wrong_shape=True)
    monkeypatch.setenv("EPD_FAULT", "never-push")
    assert main.config_from_args(_parse([])).faults == Faults(never_push=True)


def test_unknown_fault_flag_exits_with_2() -> None:
    assert main.run(_parse(["--fault", "explode"])) == 2

"""Loud, not silent: a CUDA PD whose kernel compile or graph capture fails refuses to start unless
``--enforce-eager``; the flex kernel's block size is checked at start-up; the paths in use are reported.

CPU has no CUDA, so the CUDA plan is taken for a CPU runner (``cuda_plan_double``, the ragged
kernel in place of flex) and the capture step is a double that fails (``failing_capture_double``).
The real eager static path stays what runs underneath; the real capture is exercised on a GPU only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest
import torch

from services.pd import main as pd_main
from services.pd.config import PdConfig
from services.pd.runner import decode_graphs, decode_plan, model_runner
from services.pd.runner.decode_plan import (
    DecodePathRefused,
    StaticDecodeConfig,
    StaticDecodePlan,
    check_flex_block_size,
    plan_static_decode,
    start_static_decoder,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object only: nothing is allocated on it


def test_the_plan_makes_the_cuda_path_required_unless_enforce_eager():
    assert plan_static_decode(StaticDecodeConfig(), CPU, 16) is None  # off on CPU by default
    assert plan_static_decode(StaticDecodeConfig(enabled=True), CPU, 4) == StaticDecodePlan(
        kernel="ragged", warm_up=False, capture=False, required=True
    )
    assert plan_static_decode(StaticDecodeConfig(), CUDA, 16) == StaticDecodePlan(
        kernel="flex", warm_up=True, capture=True, required=True
    )
    eager = plan_static_decode(StaticDecodeConfig(cuda_graphs=False), CUDA, 16)
    assert eager == StaticDecodePlan(kernel="flex", warm_up=True, capture=False, required=False)
    assert plan_static_decode(StaticDecodeConfig(enabled=False), CUDA, 16) is None


@pytest.mark.parametrize("block_size", [1, 8, 15, 24, 48])
def test_block_sizes_the_cuda_flex_kernel_cannot_compile_for_are_refused(block_size):
    with pytest.raises(DecodePathRefused, match=f"--block-size {block_size} .* power of two >= 16"):
        plan_static_decode(StaticDecodeConfig(), CUDA, block_size)
    with pytest.raises(DecodePathRefused):  # --enforce-eager still uses the kernel: still refused
        plan_static_decode(StaticDecodeConfig(cuda_graphs=False), CUDA, block_size)
    # Not where the kernel is not used on CUDA, nor for inductor's CPU template (tested with 4).
    assert plan_static_decode(StaticDecodeConfig(kernel="ragged"), CUDA, block_size) is not None
    assert plan_static_decode(StaticDecodeConfig(enabled=True, kernel="flex"), CPU, block_size) is not None


def test_power_of_two_block_sizes_from_16_pass():
    for block_size in (16, 32, 64, 128):
        check_flex_block_size(block_size)


class StaticDecoderDouble:
    """Stands in for ``StaticDecoder``: records the start-up stages; ``fail_at`` raises there."""

    def __init__(self, fail_at: str = "") -> None:
        self.fail_at, self.calls = fail_at, []

    def warm_up(self) -> None:
        self._stage("warm_up")

    def capture(self) -> None:
        self._stage("capture")

    def _stage(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_at:
            raise RuntimeError(f"{name} double failed\nsecond line of the cause")


CUDA_PLAN = StaticDecodePlan(kernel="flex", warm_up=True, capture=True, required=True)


@pytest.mark.parametrize("fail_at, stage", [("warm_up", "compiling"), ("capture", "capturing CUDA graphs")])
def test_a_required_path_that_fails_refuses_in_one_line_naming_the_stage_and_the_flag(fail_at, stage):
    decoder = StaticDecoderDouble(fail_at)
    with pytest.raises(DecodePathRefused) as refusal:
        start_static_decoder(lambda kernel: decoder, CUDA_PLAN)  # type: ignore[arg-type,return-value]
    message = str(refusal.value)
    assert message.startswith(stage) and "flex static decode path failed" in message
    assert f"RuntimeError: {fail_at} double failed second line" in message and "\n" not in message
    assert "--enforce-eager" in message


def test_an_optional_path_that_fails_falls_back_to_packed_steps_with_a_warning(caplog):
    decoder = StaticDecoderDouble("warm_up")
    eager = dataclasses.replace(CUDA_PLAN, capture=False, required=False)
    with caplog.at_level(logging.WARNING, logger=decode_plan_logger()):
        assert start_static_decoder(lambda kernel: decoder, eager) is None  # type: ignore[arg-type,return-value]
    assert "packed path" in caplog.text and decoder.calls == ["warm_up"]
    working = StaticDecoderDouble()
    assert start_static_decoder(lambda kernel: working, eager) is working  # type: ignore[arg-type,comparison-overlap]
    assert working.calls == ["warm_up"]  # nothing captured


def decode_plan_logger() -> str:
    return decode_plan.log.name


# -- the real runner on CPU, with the CUDA plan and a capture double -------------------------------


def cuda_plan_double(config: StaticDecodeConfig, device: torch.device, block_size: int) -> StaticDecodePlan | None:
    """``plan_static_decode`` as on CUDA, for a CPU runner: the ragged kernel in place of flex
    (the CPU cannot compile the CUDA one), warm-up, capture and requirement as CUDA decides them."""
    plan = plan_static_decode(config, CUDA, block_size)
    return None if plan is None else dataclasses.replace(plan, kernel="ragged")


class CaptureCalls:
    count = 0


def failing_capture_double(self) -> None:
    """Stands in for ``StaticDecoder.capture`` where CUDA graphs cannot be captured."""
    CaptureCalls.count += 1
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing (capture double)")


@pytest.fixture
def pretend_cuda(monkeypatch):
    CaptureCalls.count = 0
    monkeypatch.setattr(model_runner, "plan_static_decode", cuda_plan_double)
    monkeypatch.setattr(decode_graphs.StaticDecoder, "capture", failing_capture_double)


@pytest.fixture
def keep_logging(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # run() configures logging for its process
    monkeypatch.setattr(root, "level", root.level)


def _run_pd(tiny_model_dir, *flags: str) -> int:
    parser = argparse.ArgumentParser()
    pd_main.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--port", "0", "--metrics-port", "-1", *flags])
    return pd_main.run(args)


def test_a_pd_whose_graph_capture_fails_refuses_to_start(tiny_model_dir, pretend_cuda, keep_logging, capfd):
    assert _run_pd(tiny_model_dir, "--kv-cache-memory-mb", "64", "--max-num-seqs", "4") == 2
    assert CaptureCalls.count == 1
    err = capfd.readouterr().err
    refusals = [line for line in err.splitlines() if "pd cannot start" in line]
    assert len(refusals) == 1 and "Traceback" not in err
    assert "capturing CUDA graphs for the ragged static decode path failed (RuntimeError: CUDA error" in refusals[0]
    assert "--enforce-eager" in refusals[0]


def test_a_pd_refuses_a_block_size_the_flex_kernel_cannot_compile_for(
    tiny_model_dir, pretend_cuda, keep_logging, capfd
):
    assert _run_pd(tiny_model_dir, "--kv-cache-memory-mb", "64", "--block-size", "8") == 2
    assert "pd cannot start: --block-size 8 does not work with the CUDA flex_attention" in capfd.readouterr().err
    assert CaptureCalls.count == 0


def test_enforce_eager_tries_no_capture_and_reports_the_eager_static_path(tiny_model_dir, pretend_cuda):
    from services.pd.server import build_engine

    config = PdConfig(model=str(tiny_model_dir), kv_cache_memory_mb=64, max_num_seqs=4, enforce_eager=True)
    engine, facts = build_engine(config)
    assert CaptureCalls.count == 0
    assert facts["num_cuda_graphs"] == 0
    assert facts["decode_paths"] == {"static_decode": True, "flex_kernel": False, "cuda_graphs": False}
    with pytest.raises(DecodePathRefused, match="--enforce-eager"):
        build_engine(dataclasses.replace(config, enforce_eager=False))
    assert CaptureCalls.count == 1


def test_a_cpu_pd_reports_packed_decode(tiny_model_dir):
    from services.pd.server import _describe_paths, build_engine

    _, facts = build_engine(PdConfig(model=str(tiny_model_dir), kv_cache_memory_mb=64))
    assert facts["decode_paths"] == {"static_decode": False, "flex_kernel": False, "cuda_graphs": False}
    assert _describe_paths(facts["decode_paths"]) == "packed"
    assert _describe_paths({"static_decode": True, "flex_kernel": True, "cuda_graphs": True}) == (
        "static_decode+flex_kernel+cuda_graphs"
    )
